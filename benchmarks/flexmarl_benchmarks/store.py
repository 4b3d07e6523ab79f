"""Experience-store throughput: append and claim rows/s on the memory and durable (OCDBT file) backends.

Each row carries a 64-token prompt, a 256-token response and 256 behaviour log-probs (one 1-D array per row,
as a rollout produces them), a reward and an advantage. Phases per backend, each on a fresh store:

  append      one thread appends ``--rows`` rows, ``--append-batch`` rows per call, GRPO groups of
              ``--group-size`` rows (every column complete), committed when each call returns;
  claim       one trainer thread claims ``--micro-batch`` rows (whole groups, values read back) and marks
              them consumed (durable), until the table is drained;
  concurrent  ``--threads`` producers and as many consumers at once (rows/s = rows consumed / wall time).

``*_rows_per_cpu_s`` divides by the process CPU time of the phase instead of wall time (on a shared,
loaded machine the wall-clock figure mostly measures the other processes). ``lost_rows`` counts appended
rows never consumed and ``duplicated_rows`` rows consumed more than once, over the claim and concurrent
phases. The file backend also reopens its store and checks every row is consumed.

    flexmarl bench store --json store.json
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import threading
import time

import numpy as np

from flexmarl_benchmarks._output import write_json
from flexmarl_jax.store import ExperienceStore

PROMPT_TOKENS = 64


def make_columns(num_rows: int, response_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "prompt_tokens": list(rng.integers(0, 32_000, (num_rows, PROMPT_TOKENS), dtype=np.int32)),
        "response_tokens": list(rng.integers(0, 32_000, (num_rows, response_tokens), dtype=np.int32)),
        "behaviour_logprobs": list(-rng.random((num_rows, response_tokens), dtype=np.float32)),
        "reward": rng.random(num_rows, dtype=np.float32),
        "advantage": rng.standard_normal(num_rows).astype(np.float32),
    }


def append_all(store: ExperienceStore, prefix: str, num_rows: int, args, columns: dict) -> list[str]:
    appended = []
    for start in range(0, num_rows, args.append_batch):
        count = min(args.append_batch, num_rows - start)
        rows = np.arange(start, start + count)
        appended += store.append_rows(
            "solver",
            input_ids=[f"{prefix}{r // args.group_size}" for r in rows.tolist()],
            trajectory_ids=rows % args.group_size,
            group_size=args.group_size,
            policy_versions={"solver": 0, "verifier": 0},
            columns={k: v[:count] for k, v in columns.items()},
        )
    return appended


def claim_all(store: ExperienceStore, args, consumed: list, *, wait_for=None) -> None:
    """Claims and consumes until no claimable rows are left (and ``wait_for`` is set, if given)."""
    while True:
        done = wait_for is None or wait_for.is_set()
        batch = store.claim_micro_batch(
            "solver", args.micro_batch, current_versions=0, allow_partial=done, timeout=0 if done else 0.01
        )
        if batch is None:
            if done:
                return
            continue
        assert len(batch.columns["response_tokens"][0]) == args.response_tokens
        store.mark_consumed(batch)
        consumed.extend(batch.sample_ids)


def run_backend(backend: str, num_rows: int, args, workdir: str) -> dict:
    columns = make_columns(args.append_batch, args.response_tokens, seed=0)
    results = {}
    store = ExperienceStore.open(f"{workdir}/{backend}_seq", agents=["solver", "verifier"], backend=backend)
    start, cpu_start = time.perf_counter(), time.process_time()
    appended = append_all(store, "q", num_rows, args, columns)
    results["append_rows_per_s"] = num_rows / (time.perf_counter() - start)
    results["append_rows_per_cpu_s"] = num_rows / (time.process_time() - cpu_start)
    consumed: list[str] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    claim_all(store, args, consumed)
    results["claim_rows_per_s"] = len(consumed) / (time.perf_counter() - start)
    results["claim_rows_per_cpu_s"] = len(consumed) / (time.process_time() - cpu_start)
    store.close()

    concurrent_rows = num_rows // 2
    concurrent_store = ExperienceStore.open(
        f"{workdir}/{backend}_concurrent", agents=["solver", "verifier"], backend=backend
    )
    per_producer = concurrent_rows // args.threads
    producers_done = threading.Event()
    appended_concurrent: list[list[str]] = [[] for _ in range(args.threads)]
    consumed_concurrent: list[list[str]] = [[] for _ in range(args.threads)]

    def produce(worker):
        appended_concurrent[worker] = append_all(concurrent_store, f"p{worker}_", per_producer, args, columns)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(args.threads)]
    threads += [
        threading.Thread(target=claim_all, args=(concurrent_store, args, consumed_concurrent[w]),
                         kwargs={"wait_for": producers_done})
        for w in range(args.threads)
    ]  # fmt: skip
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads[: args.threads]:
        thread.join()
    producers_done.set()
    for thread in threads[args.threads :]:
        thread.join()
    elapsed = time.perf_counter() - start
    all_consumed = consumed + [s for part in consumed_concurrent for s in part]
    all_appended = appended + [s for part in appended_concurrent for s in part]
    results["concurrent_rows_per_s"] = sum(map(len, consumed_concurrent)) / elapsed
    results["lost_rows"] = len(set(all_appended) - set(all_consumed))
    results["duplicated_rows"] = sum(n - 1 for n in collections.Counter(all_consumed).values() if n > 1)
    concurrent_store.close()
    if backend == "file":
        start = time.perf_counter()
        reopened = ExperienceStore.open(f"{workdir}/{backend}_seq", backend="file")
        results["reopen_s"] = time.perf_counter() - start
        counts = reopened.counters("solver")
        results["lost_rows"] += counts["total"] - counts["consumed"]  # consumed must be durable
    return results


def print_table(results: dict) -> None:
    metrics = [
        "append_rows_per_s",
        "claim_rows_per_s",
        "concurrent_rows_per_s",
        "append_rows_per_cpu_s",
        "claim_rows_per_cpu_s",
        "lost_rows",
        "duplicated_rows",
    ]
    rows = []
    for metric in metrics:
        memory, durable = results[metric], results["file_" + metric]
        ratio = f"{durable / memory:.2f}x" if memory else "-"
        rows.append((metric, f"{memory:,.0f}", f"{durable:,.0f}", ratio))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"experience store, {results['response_tokens']}-token responses")
    for header in ("metric", "memory", "file (ocdbt)", "file / memory"):
        table.add_column(header, justify="left" if header == "metric" else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    print(f"file reopen: {results['file_reopen_s'] * 1e3:.0f} ms (rows verified durable)")
    print("rows_per_s: wall clock; rows_per_cpu_s: per second of this process's CPU time (all threads),")
    print("which is what the store costs when the machine is shared with other work.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench store", description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="write the results as a JSON object to this path")
    parser.add_argument("--rows", type=int, default=40_960, help="rows appended on the memory backend")
    parser.add_argument("--file-rows", type=int, default=16_384, help="rows appended on the file backend")
    parser.add_argument("--append-batch", type=int, default=256, help="rows per append_rows call")
    parser.add_argument("--micro-batch", type=int, default=64, help="rows per claim")
    parser.add_argument("--group-size", type=int, default=16, help="rows per GRPO group")
    parser.add_argument("--response-tokens", type=int, default=256, help="tokens per response")
    parser.add_argument("--threads", type=int, default=2, help="producer and consumer threads (each)")
    parser.add_argument("--workdir", default=None, help="where the file backend writes (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.append_batch % args.group_size or args.micro_batch % args.group_size:
        parser.error("--append-batch and --micro-batch must be multiples of --group-size")
    results = {
        "response_tokens": args.response_tokens,
        "append_batch": args.append_batch,
        "micro_batch": args.micro_batch,
        "group_size": args.group_size,
        "rows": args.rows,
        "file_rows": args.file_rows,
    }
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        results.update(run_backend("memory", args.rows, args, workdir))
        results.update(
            {f"file_{k}": v for k, v in run_backend("file", args.file_rows, args, workdir).items()}
        )
    print_table(results)
    write_json(args.json, results)
    return (
        0
        if results["lost_rows"]
        == results["duplicated_rows"]
        == results["file_lost_rows"]
        == 0
        == (results["file_duplicated_rows"])
        else 1
    )
