"""The side process of `flexmarl bench lora`'s memory figure: one process holds either a LoRA team or one
full-fine-tune agent, as a run would place them, and reports its peak resident memory.

    python -m flexmarl_benchmarks._lora_memory '{"kind": "team" | "full", "model": M, "agents": N, "rank": R,
                                                  "slots": S, "new_tokens": T, "prompt_bucket": P}'

Two devices, as a disaggregated run has: the rollout on the first, training on the second.
  team  one engine whose adapter table holds the N agents' adapters (the base once), and N LoRA trainers on the
        training device sharing one copy of the base, each with its own adapter and optimizer state
  full  one engine with the agent's whole model, and its full-fine-tune trainer (the policy and its optimizer
        state)
Each then decodes one batch (`slots` sequences, `new_tokens` each) and takes one training step per agent, so
activations, caches and the optimizer's moments are all allocated. It prints one JSON line:
{"kind", "peak_rss_bytes"}: the process's peak resident set, which includes what JAX and the checkpoint's host
copy cost, equally for both kinds. It is read from /proc/self/status (VmHWM: this program's own peak), not
`getrusage`: Linux carries ru_maxrss over fork and exec, so a child of a large bench process would report the
bench's peak instead of its own.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys


def _own_peak_rss_bytes() -> int:
    """This process image's peak resident bytes: VmHWM where /proc has it, else getrusage (kilobytes on Linux,
    bytes on macOS, which has no /proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    import jax
    import numpy as np

    from flexmarl_benchmarks._views import engine_config, lora_spec, optimizer_config, trainer_config
    from flexmarl_benchmarks.lora import _requests, _trained_adapters
    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.models.functional import init_params
    from flexmarl_jax.models.lora import AdaptedParams, adapter_table, merge_adapter
    from flexmarl_jax.models.sources import resolve_model
    from flexmarl_jax.rollout.engine import FlexEngine
    from flexmarl_jax.rollout.loop import RolloutLoop
    from flexmarl_jax.train.batch import build_micro_batch
    from flexmarl_jax.train.normalizers import IterationNormalizers
    from flexmarl_jax.train.trainer import AgentTrainer

    source = resolve_model(spec["model"])
    model_config, tokenizer = source.model_config, source.tokenizer
    graphdef, base = source.initial_weights(dtype=np.float32) or init_params(model_config, seed=0)
    rollout_mesh, train_mesh = (make_mesh([device], fsdp=1) for device in jax.devices()[:2])
    adapter_spec = lora_spec(rank=spec["rank"], alpha=2.0 * spec["rank"])
    team = spec["kind"] == "team"
    count = spec["agents"] if team else 1
    adapters = _trained_adapters(model_config, adapter_spec, count, seed=0)

    rollout_params = (AdaptedParams(base, adapter_table(adapters, [adapter_spec] * count)) if team
                      else merge_adapter(base, adapters[0], adapter_spec))
    rollout_params = jax.device_put(rollout_params, rollout_mesh.devices.flat[0])
    config = engine_config(max_concurrent_decodes=spec["slots"], max_prefill_length=spec["prompt_bucket"],
                           max_decode_length=spec["new_tokens"], prefill_buckets=(spec["prompt_bucket"],),
                           prefill_batch_sizes=(1, 4))
    engine = FlexEngine(model_config, graphdef, config, tokenizer, mesh=rollout_mesh, params=rollout_params)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(3, min(model_config.vocab_size, 5000), size=spec["prompt_bucket"]))
               for _ in range(spec["slots"])]
    RolloutLoop(engine, rollout_params).generate(_requests(prompts, spec["new_tokens"]),
                                                 [index % count for index in range(len(prompts))] if team else None)

    train_base = jax.device_put(base, train_mesh.devices.flat[0])  # one copy on the training device, shared
    del base
    trainer_settings = trainer_config(max_len=2 * spec["prompt_bucket"] + 1, micro_batch_size=2, remat=True,
                                      lora=adapter_spec if team else lora_spec(rank=0),
                                      optimizer=optimizer_config(learning_rate=1e-5))
    rows, response = 2, spec["prompt_bucket"]
    batch = functools.partial(
        build_micro_batch, prompt_ids=[[3] * response] * rows, response_ids=[[4] * response] * rows,
        behaviour_logprobs=[[-1.0] * response] * rows, advantages=[1.0, -1.0], aggregation="token_mean",
        normalizers=IterationNormalizers.from_response_lengths([response] * rows, norm_length=response),
        batch_size=rows, max_len=trainer_settings.max_len)
    trainers = []
    for index in range(count):
        trainer = AgentTrainer(f"agent{index}", model_config, trainer_settings, mesh=train_mesh, seed=index,
                               initial=(graphdef, train_base))
        trainer.accumulate(batch(agent=trainer.agent))
        trainer.apply()
        jax.block_until_ready(jax.tree.leaves(trainer.rollout_weights))
        trainers.append(trainer)
    peak = _own_peak_rss_bytes()
    print(json.dumps({"kind": spec["kind"], "agents": count, "peak_rss_bytes": peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
