"""`flexmarl bench export_accuracy WORKDIR`: does a trained agent's gain survive `flexmarl export`, measured by
transformers; and how fast our engine decodes against transformers' `generate` on the same prompts.

For one agent of a finished `flexmarl train` run whose prompts depend on the problem only (a root node: the chain's
solver), on the run's own held-out eval problems (the list its evals used):
- exports the agent at `--version` (default: the newest evaluated version) with `flexmarl export`'s code into a
  temporary directory, and reloads it in transformers (AutoModelForCausalLM, AutoTokenizer, float32, CPU);
- renders each problem's prompt with the workflow and the checkpoint's own chat template
  (`apply_chat_template`), and checks the token ids equal ours (`prompt_ids_equal`);
- greedy `generate` in batches of `--batch` (left-padded), up to the run's `rollout.max_response_length` tokens,
  ending a row at EOS or at the agent's `stop_pattern` as the rollout does; the task's parser and verifier score
  the answers;
- the same for the untrained model (the agent's `model` directory);
- reads our own greedy measure of the agent (`agent/<agent>/eval_accuracy` in metrics.jsonl) at both versions.

Speed (without `--no-speed`): the trained model's greedy decode of the same prompts by transformers (static
batches of `--batch`) and by our engine (one instance, `--batch` decode slots, continuous batching), each after a
warm-up batch that is not timed (its seconds are reported). Output tokens per second; `ours_vs_transformers` is
their ratio, measured in one process one after the other.

JSON keys:
  version, problems, prompt_ids_equal
  greedy_tokens_equal_fraction         trained model: our engine's greedy tokens == transformers' (with speed)
  accuracy.{trained,untrained}.{transformers,ours}   fractions in [0, 1] (ours: None when not evaluated)
  trained_minus_ours_points            transformers - ours at the trained version, in points
  trained_minus_untrained_points       transformers trained - transformers untrained, in points
  speed.{transformers,ours}.{tokens,seconds,tokens_per_s,warmup_s}, speed.ours_vs_transformers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from flexmarl_benchmarks._output import write_json
from flexmarl_benchmarks._views import engine_config as default_engine_config


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench export_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="a finished `flexmarl train` workdir")
    parser.add_argument("--agent", default="solver", help="an agent whose prompt depends on the problem only")
    parser.add_argument("--version", type=int, default=None, help="policy version (default: newest evaluated)")
    parser.add_argument("--batch", type=int, default=32, help="rows per generate call and decode slots")
    parser.add_argument("--problems", type=int, default=None, help="the first N eval problems (default: all)")
    parser.add_argument("--no-speed", action="store_true", help="accuracy only")
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    return parser.parse_args(argv)


def eval_records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as handle:
        return [record for line in handle if line.strip() and (record := json.loads(line)).get("kind") == "eval"]


def our_accuracy(records: list[dict], agent: str, version: int) -> float | None:
    """Our greedy `eval_accuracy` of `agent` at `version` (the newest record at that version), or None."""
    found = [r for r in records if r["policy_version"].get(agent) == version]
    return found[-1]["agent"][agent]["eval_accuracy"] if found else None


def run_problems(config, agent: str, limit: int | None):
    """(eval problems, their prompts for `agent`, the node that answers, the task's verify)."""
    from flexmarl_jax.config.workflow_from_config import split_task_from_config, workflow_from_config
    from flexmarl_jax.workflows.splits import EVAL_PROBLEMS_SEED

    workflow = workflow_from_config(config.workflow, chat_models=True)
    nodes = [name for name in workflow.roots() if workflow.nodes[name].agent == agent]
    if not nodes:
        raise SystemExit(f"flexmarl bench export_accuracy: agent {agent!r} plays no root node of the workflow "
                         f"(roots: {', '.join(workflow.roots())}); its prompts depend on other agents' responses")
    node = nodes[0]
    task = split_task_from_config(config.workflow, config.eval)
    problems = task.eval_problems(config.eval.problems, seed=EVAL_PROBLEMS_SEED)[:limit]
    prompts = [workflow.render_prompt(node, problem.prompt, {}) for problem in problems]
    return problems, prompts, workflow.nodes[node], task.verify


class _StopPattern:
    """transformers StoppingCriteria: a row is done once its last 64 new tokens hold a match (as the rollout)."""

    def __init__(self, pattern: str, tokenizer, prompt_length: int):
        self.pattern, self.tokenizer, self.prompt_length = pattern, tokenizer, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        tails = self.tokenizer.batch_decode(input_ids[:, self.prompt_length:][:, -64:])
        return torch.tensor([bool(re.search(self.pattern, tail)) for tail in tails], device=input_ids.device)


def transformers_greedy(directory: str, messages: list[list[dict]], *, max_new_tokens: int, stop_pattern: str,
                        batch: int) -> tuple[list[str], list[list[int]], list[list[int]], dict]:
    """Greedy completions of every prompt (texts, prompt ids, completion ids, timing of the batches after the
    first)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt_ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)) for m in messages]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts, completions, tokens, seconds, warmup_s = [], [], 0, 0.0, None
    for start in range(0, len(prompt_ids), batch):
        rows = prompt_ids[start:start + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        criteria = transformers.StoppingCriteriaList(
            [_StopPattern(stop_pattern, tokenizer, width)] if stop_pattern else [])
        began = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, stopping_criteria=criteria, pad_token_id=pad)
        elapsed = time.perf_counter() - began
        for row in out[:, width:].tolist():
            kept = _until_end(row, tokenizer, stop_pattern)
            completions.append(kept)
            texts.append(tokenizer.decode(kept, skip_special_tokens=True))
            if start:
                tokens += len(kept)
        if start:
            seconds += elapsed
        else:
            warmup_s = elapsed
    return texts, prompt_ids, completions, {"tokens": tokens, "seconds": seconds, "warmup_s": warmup_s,
                               "tokens_per_s": tokens / seconds if seconds else None}


def _until_end(row: list[int], tokenizer, stop_pattern: str) -> list[int]:
    """A generated row up to its first EOS (kept) or the token that completes the stop pattern's first match;
    a batch keeps generating for its other rows, so what follows is padding or text the rollout never sees."""
    eos = set(tokenizer.all_special_ids) & {tokenizer.eos_token_id, *(
        [tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else [])}
    for end in range(1, len(row) + 1):
        if row[end - 1] in eos:
            return row[:end]
        if stop_pattern and re.search(stop_pattern, tokenizer.decode(row[max(0, end - 64):end])):
            return row[:end]
    return row


def ours_greedy(source, prompt_ids: list[list[int]], *, max_new_tokens: int, stop_pattern: str,
                batch: int, max_prompt_length: int) -> tuple[list[list[int]], dict]:
    """Greedy completions by our engine and rollout loop with `batch` slots (timing after a warm-up batch)."""
    import jax

    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
    from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest

    mesh = make_mesh(jax.devices()[:1], fsdp=1)
    graphdef, params = source.initial_weights(mesh=mesh)
    engine_config = default_engine_config(max_concurrent_decodes=batch, max_prefill_length=max_prompt_length,
                                          max_decode_length=max_new_tokens)
    engine = FlexEngine(source.model_config, graphdef, engine_config, source.tokenizer, mesh=mesh,
                        cache_dtype=jax.tree.leaves(params)[0].dtype)
    loop = RolloutLoop(engine, params)

    def requests(rows):
        return [RolloutRequest(tuple(ids), max_new_tokens=max_new_tokens, stop_pattern=stop_pattern,
                               sampling=SlotSampling(temperature=0.0)) for ids in rows]

    began = time.perf_counter()
    engine.warm_up(params)
    warm = loop.generate(requests(prompt_ids[:batch]))
    warmup_s = time.perf_counter() - began
    began = time.perf_counter()
    rest = loop.generate(requests(prompt_ids[batch:]))
    seconds = time.perf_counter() - began
    results = [r[0] for r in warm + rest]
    tokens = sum(len(r[0].token_ids) for r in rest)
    return [list(r.token_ids) for r in results], {"tokens": tokens, "seconds": seconds, "warmup_s": warmup_s,
                   "tokens_per_s": tokens / seconds if seconds else None}


def accuracy(texts: list[str], problems, node, verify) -> float:
    return sum(bool(verify(problem, node.parse(text))) for problem, text in zip(problems, texts, strict=True)) / len(
        problems)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from flexmarl_jax.orchestrator.export import export_agent, read_run_config

    config = read_run_config(args.workdir)
    records = eval_records(args.workdir)
    evaluated = sorted({r["policy_version"][args.agent] for r in records if args.agent in r["policy_version"]})
    version = args.version if args.version is not None else (evaluated[-1] if evaluated else None)
    problems, prompts, node, verify = run_problems(config, args.agent, args.problems)
    settings = config.agents[args.agent]
    generation = dict(max_new_tokens=config.rollout.max_response_length, stop_pattern=settings.stop_pattern,
                      batch=args.batch)
    messages = [prompt.messages for prompt in prompts]
    result: dict[str, Any] = {"workdir": args.workdir, "agent": args.agent, "version": version,
                              "problems": len(problems), "accuracy": {}}
    with tempfile.TemporaryDirectory(prefix="flexmarl-export-") as scratch:
        exported = export_agent(args.workdir, args.agent, os.path.join(scratch, args.agent), policy_version=version)
        print(f"exported {args.agent} v{exported.policy_version} to {exported.out}", flush=True)
        for label, directory, at in (("untrained", settings.model, 0), ("trained", exported.out, version)):
            texts, prompt_ids, completions, timing = transformers_greedy(directory, messages, **generation)
            result["accuracy"][label] = {"transformers": accuracy(texts, problems, node, verify),
                                         "ours": our_accuracy(records, args.agent, at)}
            print(f"{label}: transformers {result['accuracy'][label]['transformers']:.3f}, ours "
                  f"{result['accuracy'][label]['ours']}", flush=True)
            if label == "trained":
                from flexmarl_jax.models.sources import resolve_model
                from flexmarl_jax.rollout.backend import encode_prompt

                source = resolve_model(directory)  # our loader's view of the export: tokenizer, then weights
                ours_ids = [encode_prompt(source.tokenizer, p) for p in prompts]
                result["prompt_ids_equal"] = ours_ids == prompt_ids
                if not args.no_speed:
                    ours_completions, ours_timing = ours_greedy(source, prompt_ids, **generation,
                                                                max_prompt_length=config.rollout.max_prompt_length)
                    result["greedy_tokens_equal_fraction"] = sum(
                        a == b for a, b in zip(ours_completions, completions, strict=True)) / len(completions)
                    result["speed"] = {"transformers": timing, "ours": ours_timing,
                                       "ours_vs_transformers": (ours_timing["tokens_per_s"] or 0)
                                       / timing["tokens_per_s"] if timing["tokens_per_s"] else None}
    trained, untrained = result["accuracy"]["trained"], result["accuracy"]["untrained"]
    result["trained_minus_ours_points"] = (100 * (trained["transformers"] - trained["ours"])
                                           if trained["ours"] is not None else None)
    result["trained_minus_untrained_points"] = 100 * (trained["transformers"] - untrained["transformers"])
    print(json.dumps({k: v for k, v in result.items() if k != "workdir"}, indent=1))
    write_json(args.json, result)
    return 0
