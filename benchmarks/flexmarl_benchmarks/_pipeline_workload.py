"""The pipeline benchmark's workload: its sizes, seeded long-tailed response lengths and the skew-shaping
generation backend (see `flexmarl_benchmarks.pipeline` for how the modes use it)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import zlib


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one iteration of every mode does: the batch shape of `flexmarl train` (16 queries x 8 samples,
    micro-batches of 32), with responses long-tailed up to 128 tokens as in RL on reasoning tasks."""

    queries_per_iteration: int = 16
    samples_per_query: int = 8
    micro_batch_size: int = 32
    max_response_length: int = 128  # the length cap: the longest tail call
    tail_min_length: int = 8  # the Pareto scale: the shortest call
    tail_alpha: float = 1.0  # Pareto shape: P(length > x) = (tail_min_length / x) ** alpha
    reject_rate: float = 0.3  # share of trajectories whose verifier rejects: the corrector's load
    warmup_iterations: int = 1
    iterations: int = 3  # timed; each iteration draws new queries, so more iterations average the tail draws

    @property
    def global_batch_size(self) -> int:
        return self.queries_per_iteration * self.samples_per_query


FULL = Workload()
QUICK = Workload(queries_per_iteration=4, samples_per_query=4, micro_batch_size=8, max_response_length=8,
                 tail_min_length=2, warmup_iterations=1, iterations=1)


# ------------------------------------------------------------------------------------ long tail


def seeded_uniform(seed: int, key: str) -> float:
    """A uniform draw in (0, 1) that is a pure function of (seed, key)."""
    return (zlib.crc32(f"{seed}/{key}".encode()) + 0.5) / 2**32


def long_tail_length(key: str, *, seed: int, min_length: int, max_length: int, alpha: float) -> int:
    """A bounded-Pareto response length in [min_length, max_length], a pure function of (seed, key)."""
    u = seeded_uniform(seed, f"length/{key}")
    return int(min(max_length, math.floor(min_length * u ** (-1.0 / alpha))))


def length_key(request_id: str) -> str:
    """`agent/input_turn_trajectory` -> `agent/input_turn`: a grouped request (`_*`) and its per-trajectory
    twins share a key."""
    return request_id.rsplit("_", 1)[0]


class WorkloadBackend:
    """Wraps the run's GenerationBackend to shape the workload the same way in every mode.

    - Lengths: every request's `max_new_tokens` becomes its long-tail draw (`long_tail_length`).
    - Skew: a completion of `verdict_agent` gets a seeded verdict line ("N" with probability `reject_rate`)
      in front of its text, so the corrector serves ~`reject_rate` of the trajectories, as behind a verifier
      that has learnt the format. Random-init policies almost never write a parsable verdict, which would
      leave the corrector with no load at all. Only the text the workflow parses changes; the tokens and
      log-probs that are trained on are the model's.
    """

    def __init__(self, backend, workload: Workload, *, seed: int, verdict_agent: str | None,
                 reject_rate: float | None = None):
        self.backend, self.workload, self.seed = backend, workload, seed
        self.verdict_agent = verdict_agent
        self.reject_rate = workload.reject_rate if reject_rate is None else reject_rate

    def length_for(self, request_id: str) -> int:
        w = self.workload
        return long_tail_length(length_key(request_id), seed=self.seed, min_length=w.tail_min_length,
                                max_length=w.max_response_length, alpha=w.tail_alpha)

    def verdict_for(self, request_id: str, sample: int) -> str:
        return "N" if seeded_uniform(self.seed, f"verdict/{request_id}/{sample}") < self.reject_rate else "Y"

    def submit(self, request):
        sampling = dataclasses.replace(request.sampling, max_new_tokens=self.length_for(request.request_id))
        inner = self.backend.submit(dataclasses.replace(request, sampling=sampling))
        if request.agent != self.verdict_agent:
            return inner
        outer: concurrent.futures.Future = concurrent.futures.Future()
        outer.set_running_or_notify_cancel()

        def with_verdicts(future: concurrent.futures.Future) -> None:
            try:
                completions = future.result()
            except BaseException as error:  # the executor reports it with the request id
                outer.set_exception(error)
                return
            outer.set_result([
                dataclasses.replace(c, text=f"{self.verdict_for(request.request_id, i)}\n{c.text}")
                for i, c in enumerate(completions)])

        inner.add_done_callback(with_verdicts)
        return outer
