"""A lower bound on an emulated iteration's E2E, from the cost model and the workload the iteration ran.

No schedule of the iteration can beat either of:

* the critical path: the longest chain of dependent decodes (one trajectory's calls along the workflow's
  edges, each call its prompt's prefill and its response's decode steps), then what cannot start before the
  chain's last call is done: a training step of that one row, the agent's optimizer update and its weight
  sync. Each call is costed alone, at batch 1: a step of more slots costs at least as much, and waiting for
  a slot only adds. A decode of L steps from context P is charged L steps at the mean context P + (L - 1) / 2:
  a step's cost is the larger of two affine functions of the context (the roofline), convex, so the L steps
  cost at least that (Jensen);
* the training: the micro-batches the trainers computed (their charged device seconds), over as many meshes
  as the mode trains on, no agent faster than its own share on one mesh, then one optimizer update and one
  weight sync. None of it can start before some query's group is complete: a row's reward is written when its
  trajectory ends (the team's answer), and a micro-batch takes whole GRPO groups, whose advantages need every
  sample's reward (orchestrator/sink.py). So, on policy, the training starts no earlier than the first query
  whose trajectories' chains (costed as above) have all ended.

`lower_bound_s` is the larger, per iteration. It takes the workload as realised (each call's prompt and
response lengths, recorded by `CallRecorder`), so it bounds that iteration, not an expectation.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any


class CallRecorder:
    """Wraps a generation backend: every completed call's (agent, input id, turn, [(prompt, response) tokens
    per sample, in trajectory order]) goes to `calls`. `take()` returns and clears them (one iteration's)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._calls: list[tuple[str, str, int, list[tuple[int, int]]]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # the rest of the backend's interface (close, update_params, ...)
        return getattr(self.backend, name)

    def submit(self, request: Any) -> concurrent.futures.Future:
        future = self.backend.submit(request)
        agent, _, key = request.request_id.partition("/")
        input_id, turn, _ = key.rsplit("_", 2)  # "{input_id}_{turn}_{trajectory or *}"; ids may hold "_"

        def record(done: concurrent.futures.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            lengths = [(len(c.prompt_token_ids), len(c.token_ids)) for c in done.result()]
            with self._lock:
                self._calls.append((agent, input_id, int(turn), lengths))

        future.add_done_callback(record)
        return future

    def take(self) -> list[tuple[str, str, int, list[tuple[int, int]]]]:
        with self._lock:
            calls, self._calls = self._calls, []
        return calls


def decode_call_s(cost_model: Any, prompt: int, response: int) -> float:
    """A call's least device time alone: its prefill and `response` decode steps at batch 1 (see above)."""
    steps = cost_model.decode_step_s(1, prompt + (response - 1) / 2) * response if response else 0.0
    return cost_model.prefill_s(1, prompt) + steps


def trajectory_chains(calls: Sequence[tuple[str, str, int, list[tuple[int, int]]]], workflow: Any,
                      rollout: Any) -> dict[tuple[str, int], tuple[float, str, int]]:
    """(input id, sample index) -> (seconds of that trajectory's longest chain of calls, the agent of the call that
    ends it, that call's row length). A query's calls list their samples in trajectory order."""
    node_of = {(workflow.nodes[name].agent, workflow.turn[name]): name for name in workflow.nodes}
    by_trajectory: dict[tuple[str, int], dict[str, tuple[int, int]]] = defaultdict(dict)
    for agent, input_id, turn, lengths in calls:
        node = node_of.get((agent, turn))
        if node is None:
            raise ValueError(f"call of {agent!r} at turn {turn} matches no node of workflow {workflow.name!r}")
        for sample, pair in enumerate(lengths):
            by_trajectory[(input_id, sample)][node] = pair
    chains = {}
    for trajectory, nodes in by_trajectory.items():
        finish: dict[str, float] = {}
        longest = (0.0, "", 0)
        for node in workflow.order:
            if node not in nodes:
                continue  # not called in this trajectory (a condition was false)
            prompt, response = nodes[node]
            start = max((finish[up] for up in workflow.upstream[node] if up in finish), default=0.0)
            finish[node] = start + decode_call_s(rollout, prompt, response)
            if finish[node] > longest[0]:
                longest = (finish[node], workflow.nodes[node].agent, prompt + response)
        chains[trajectory] = longest
    return chains


def critical_path(calls: Sequence[tuple[str, str, int, list[tuple[int, int]]]], workflow: Any,
                  rollout: Any) -> tuple[float, str | None, int]:
    """(seconds of the longest dependent chain of calls, the agent of its last call, that call's row length)."""
    return _longest(trajectory_chains(calls, workflow, rollout))


def first_group_s(calls: Sequence[tuple[str, str, int, list[tuple[int, int]]]], workflow: Any,
                  rollout: Any) -> float:
    """The earliest a query's group can be complete: over queries, the least of its trajectories' longest chain."""
    return _first_group(trajectory_chains(calls, workflow, rollout))


def _longest(chains: Mapping[tuple[str, int], tuple[float, str, int]]) -> tuple[float, str | None, int]:
    seconds, agent, length = max(chains.values(), default=(0.0, None, 0))
    return (seconds, agent, length) if seconds > 0 else (0.0, None, 0)


def _first_group(chains: Mapping[tuple[str, int], tuple[float, str, int]]) -> float:
    by_query: dict[str, float] = {}
    for (input_id, _), (seconds, _, _) in chains.items():
        by_query[input_id] = max(by_query.get(input_id, 0.0), seconds)
    return min(by_query.values(), default=0.0)


def iteration_lower_bound(calls: Sequence[tuple[str, str, int, list[tuple[int, int]]]], workflow: Any, *,
                          rollout: Any, train: Any, sync_s: float,
                          micro_batch_s: Mapping[str, Sequence[float]], meshes: int,
                          on_policy: bool = True) -> dict[str, float]:
    """The bound's parts for one iteration (device seconds): `micro_batch_s` agent -> its micro-batches'
    charged seconds; `meshes` the training meshes the mode trains on (shared slices, or one per agent). Off
    policy (staleness > 0) an iteration may train the previous rollout's rows, so its training need not wait
    for this rollout's first group."""
    chains = trajectory_chains(calls, workflow, rollout)  # once, for both parts
    chain, last_agent, last_length = _longest(chains)
    tail = (train.train_micro_batch_s(1, last_length) + train.optimizer_apply_s() + sync_s) if last_agent else 0.0
    per_agent = [sum(seconds) for seconds in micro_batch_s.values()]
    first_group = _first_group(chains) if on_policy else 0.0
    training = (first_group + max(max(per_agent, default=0.0), sum(per_agent) / meshes) + train.optimizer_apply_s()
                + sync_s if any(per_agent) else 0.0)
    return {"critical_path_s": chain, "tail_s": tail, "first_group_s": first_group, "training_s": training,
            "lower_bound_s": max(chain + tail, training)}
