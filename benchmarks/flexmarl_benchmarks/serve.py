"""`flexmarl bench serve [WORKDIR]`: what serving over the OpenAI API costs, against the same engine in process
and against transformers' `generate` answering the same requests one by one.

One agent of a trained run (WORKDIR; without it a `cpu_smoke` run is trained first: the SmolLM2 recipe's when its
checkpoint is there, else `configs/gsm8k_chain.py:cpu_smoke`) is served by `flexmarl serve --api openai` in a
subprocess with `--slots` decode slots. Every request is a chat prompt of its own (a numbered word problem) and
generates exactly `--max-tokens` tokens (`ignore_eos`), at temperature 0.7 with its own seed, so every way of
serving does the same work:

- served: for each concurrency in `--concurrency`, `--requests-per-slot` x concurrency streamed chat requests
  (at least 8) from that many client threads (the `openai` client): time to first token per request, output
  tokens/s and requests/s over the whole batch;
- in process: the same prompts and lengths through a `RolloutLoop` on an engine of the server's shapes, all
  submitted at once (the best a server of these slots could do);
- transformers: the agent exported with `flexmarl export`'s code, `generate` one request at a time
  (`--transformers-requests` of them), sampled, `min_new_tokens` = `max_new_tokens` = `--max-tokens`.

Each figure is the median of `--repeats` runs; a warm-up round before them is not timed (its seconds are
reported). The server compiles its engine before it says it is ready; that is left out too (`server_start_s`).

JSON keys:
  agent, slots, max_tokens, server_start_s, warmup_s, repeats
  concurrency.<c>.{requests, completed, output_tokens_per_s, requests_per_s, ttft_s_median, ttft_s_p90, wall_s}
  in_process.{requests, output_tokens_per_s, wall_s}
  transformers_one_by_one.{requests, output_tokens_per_s, seconds_per_request, ttft_s_median}
  served32_vs_in_process_tokens_per_s    served output tokens/s at the highest concurrency / in process
  served32_vs_transformers_tokens_per_s  the same against transformers one by one
  all_completed                          every served request of every concurrency completed
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import jax
from openai import OpenAI

from flexmarl_benchmarks._output import write_json
from flexmarl_jax.cli.main import main as flexmarl_main
from flexmarl_jax.orchestrator.export import export_agent
from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.serve.openai_server import openai_engine_config
from flexmarl_jax.serve.served_agent import build_engine, load_agent, read_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(os.environ.get("FLEXMARL_CHECKPOINTS", "checkpoints"), "SmolLM2-135M-Instruct")
NAMES = ["Ava", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana"]
TEMPERATURE = 0.7


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", help="a trained run (default: train a cpu_smoke run first)")
    parser.add_argument("--agent", default="solver")
    parser.add_argument("--slots", type=int, default=32, help="the server's decode slots")
    parser.add_argument("--concurrency", default="1,8,32", help="client threads, comma-separated")
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per client thread (>= 8 in all)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens every request generates")
    parser.add_argument("--transformers-requests", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    return parser.parse_args(argv)


def question(index: int) -> str:
    name = NAMES[index % len(NAMES)]
    return f"{name} has {index + 3} apples and buys {2 * index + 1} more. How many apples does {name} have now?"


def train_default_run(scratch: str) -> str:
    """A cpu_smoke run to serve: SmolLM2's when its checkpoint is there (docs/recipes.md), else the synthetic one."""
    config = ("configs/smollm2_team.py:cpu_smoke" if os.path.isfile(os.path.join(SMOLLM2, "config.json"))
              else "configs/gsm8k_chain.py:cpu_smoke")
    workdir = os.path.join(scratch, "run")
    print(f"serve bench: training {config} into {workdir}", flush=True)
    if flexmarl_main(["train", f"--config={os.path.join(REPO, config.split(':')[0])}:{config.split(':')[1]}",
             f"--workdir={workdir}"]) != 0:
        raise SystemExit("serve bench: the run to serve did not train")
    return workdir


class Server:
    """`flexmarl serve --api openai` in a subprocess on a free port."""

    def __init__(self, workdir: str, agent: str, slots: int, max_tokens: int):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flexmarl_jax.cli.main", "serve", workdir, "--api", "openai", "--agent", agent,
             "--slots", str(slots), "--max-new-tokens", str(max_tokens), "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        while True:
            line = self.lines.get(timeout=900)
            if line is None:
                raise SystemExit("serve bench: the server ended before it was ready")
            if "ready" in line:
                break
        self.start_s = time.perf_counter() - started

    def _read(self) -> None:
        for line in self.process.stdout:
            print(f"  {line.rstrip()}", flush=True)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@dataclasses.dataclass(frozen=True)
class Served:
    ttft_s: float
    tokens: int


def one_request(client, agent: str, index: int, max_tokens: int) -> Served:
    started = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=agent, messages=[{"role": "user", "content": question(index)}], max_tokens=max_tokens,
        temperature=TEMPERATURE, seed=index, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Served(first if first is not None else time.perf_counter() - started, tokens)


def served_round(port: int, agent: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0, timeout=600)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one_request, client, agent, index, max_tokens) for index in range(requests)]
        done = [future.result() for future in futures if future.exception() is None]
    wall = time.perf_counter() - started
    ttfts = sorted(result.ttft_s for result in done)
    tokens = sum(result.tokens for result in done)
    return {"requests": requests, "completed": sum(result.tokens == max_tokens for result in done),
            "output_tokens_per_s": tokens / wall, "requests_per_s": len(done) / wall, "wall_s": wall,
            "ttft_s_median": statistics.median(ttfts), "ttft_s_p90": ttfts[int(0.9 * (len(ttfts) - 1))]}


def in_process_round(workdir: str, agent: str, slots: int, max_tokens: int, requests: int) -> dict:
    """The same prompts and lengths on the server's engine shapes, in this process, all submitted at once."""
    run = read_run(workdir)
    served = load_agent(workdir, agent, run=run)
    config = openai_engine_config(run, agent, slots=slots, max_new_tokens=max_tokens)
    engine, params = build_engine(served, config, jax.devices()[0])
    engine.warm_up(params)
    loop = RolloutLoop(engine, params)
    tokenizer = served.tokenizer

    def prompt(index: int) -> tuple[int, ...]:
        text = tokenizer.render_chat([{"role": "user", "content": question(index)}], add_generation_prompt=True)
        return tuple(tokenizer.encode(text, add_bos=False))

    def batch(count: int) -> list[RolloutRequest]:
        return [RolloutRequest(prompt(i), max_new_tokens=max_tokens, ignore_eos=True,
                               sampling=SlotSampling(temperature=TEMPERATURE, seed=i)) for i in range(count)]

    loop.generate(batch(min(requests, slots)))  # warm-up (not timed)
    started = time.perf_counter()
    results = loop.generate(batch(requests))
    wall = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for (r,) in results)
    return {"requests": requests, "output_tokens_per_s": tokens / wall, "wall_s": wall}


def transformers_round(workdir: str, agent: str, max_tokens: int, requests: int) -> dict:
    """The exported agent, `generate` one request at a time (sampled, fixed length)."""
    # lazy: torch and transformers (about 3 s to import) serve this round only
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, agent)
        export_agent(workdir, agent, out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(out)

    def ids(index: int):
        return tokenizer.apply_chat_template([{"role": "user", "content": question(index)}],
                                             add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def generate(index: int, new_tokens: int) -> float:
        torch.manual_seed(index)
        encoded = ids(index)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(**encoded, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                           temperature=TEMPERATURE, top_p=1.0, top_k=0, pad_token_id=tokenizer.eos_token_id)
        return time.perf_counter() - started

    generate(0, 4)  # warm-up
    first_token = sorted(generate(i, 1) for i in range(requests))
    seconds = [generate(i, max_tokens) for i in range(requests)]
    return {"requests": requests, "output_tokens_per_s": requests * max_tokens / sum(seconds),
            "seconds_per_request": statistics.median(seconds), "ttft_s_median": statistics.median(first_token)}


def median_of(rounds: list[dict]) -> dict:
    """Each figure's median over repeats; counts of requests and completions are the smallest seen."""
    return {key: statistics.median(r[key] for r in rounds) if isinstance(rounds[0][key], float)
            else min(r[key] for r in rounds) for key in rounds[0]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or train_default_run(scratch)
        server = Server(workdir, args.agent, args.slots, args.max_tokens)
        try:
            started = time.perf_counter()
            served_round(server.port, args.agent, min(levels[-1], args.slots), args.slots, args.max_tokens)
            warmup_s = time.perf_counter() - started
            rounds: dict[int, list[dict]] = {c: [] for c in levels}
            for repeat in range(args.repeats):
                for level in levels:
                    result = served_round(server.port, args.agent, level, max(8, args.requests_per_slot * level),
                                          args.max_tokens)
                    rounds[level].append(result)
                    print(f"serve bench: repeat {repeat + 1}/{args.repeats}, concurrency {level}: "
                          f"{result['output_tokens_per_s']:.1f} tokens/s, {result['requests_per_s']:.2f} requests/s, "
                          f"TTFT median {result['ttft_s_median']:.2f} s, {result['completed']}/{result['requests']} "
                          "complete", flush=True)
        finally:
            server.stop()
        top = levels[-1]
        top_requests = max(8, args.requests_per_slot * top)
        in_process = median_of([in_process_round(workdir, args.agent, args.slots, args.max_tokens, top_requests)
                                for _ in range(args.repeats)])
        print(f"serve bench: in process {in_process['output_tokens_per_s']:.1f} tokens/s", flush=True)
        hf = transformers_round(workdir, args.agent, args.max_tokens, args.transformers_requests)
        print(f"serve bench: transformers one by one {hf['output_tokens_per_s']:.1f} tokens/s", flush=True)
    concurrency = {str(level): median_of(rounds[level]) for level in levels}
    result = {
        "agent": args.agent, "slots": args.slots, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "server_start_s": server.start_s, "warmup_s": warmup_s, "concurrency": concurrency,
        "in_process": in_process, "transformers_one_by_one": hf,
        "served32_vs_in_process_tokens_per_s": concurrency[str(top)]["output_tokens_per_s"]
        / in_process["output_tokens_per_s"],
        "served32_vs_transformers_tokens_per_s": concurrency[str(top)]["output_tokens_per_s"]
        / hf["output_tokens_per_s"],
        "all_completed": all(r["completed"] == r["requests"] for rs in rounds.values() for r in rs),
    }
    print(f"{'concurrency':>12} {'tokens/s':>10} {'requests/s':>11} {'TTFT median':>12} {'complete':>9}")
    for level, figures in concurrency.items():
        print(f"{level:>12} {figures['output_tokens_per_s']:>10.1f} {figures['requests_per_s']:>11.2f} "
              f"{figures['ttft_s_median']:>11.2f}s {figures['completed']:>4}/{figures['requests']}")
    print(f"in process {in_process['output_tokens_per_s']:.1f} tokens/s; served/in-process "
          f"{result['served32_vs_in_process_tokens_per_s']:.2f}; transformers one by one "
          f"{hf['output_tokens_per_s']:.1f} tokens/s")
    write_json(args.json, result)
    return 0
