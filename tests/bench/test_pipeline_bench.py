"""benchmarks/flexmarl_benchmarks/pipeline.py: the workload shaping, the store timing proxy, the accounting, and a very
small end-to-end run of every mode (JSON structure and invariants; no speed asserts)."""

import concurrent.futures
import dataclasses
import json
import statistics
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl_benchmarks import pipeline
from flexmarl_jax.workflows.generation import Completion, GenerationRequest, SamplingParams


@given(key=st.text(min_size=1, max_size=30), seed=st.integers(0, 2**31), min_length=st.integers(1, 8),
       extra=st.integers(0, 64), alpha=st.floats(0.3, 3.0))
def test_long_tail_length_is_bounded_and_deterministic(key, seed, min_length, extra, alpha):
    kwargs = dict(seed=seed, min_length=min_length, max_length=min_length + extra, alpha=alpha)
    length = pipeline.long_tail_length(key, **kwargs)
    assert min_length <= length <= min_length + extra
    assert length == pipeline.long_tail_length(key, **kwargs)


def test_long_tail_length_follows_the_bounded_pareto_law():
    lengths = [pipeline.long_tail_length(f"solver/q{i}_0", seed=3, min_length=2, max_length=32, alpha=1.0)
               for i in range(4000)]
    share = lambda predicate: sum(map(predicate, lengths)) / len(lengths)  # noqa: E731
    # P(L >= x) = 2 / x for x <= 32 (floor of a Pareto(scale 2, alpha 1) draw, capped at 32).
    assert share(lambda n: n >= 32) == pytest.approx(2 / 32, abs=0.015)
    assert share(lambda n: n >= 8) == pytest.approx(2 / 8, abs=0.03)
    assert share(lambda n: n <= 3) == pytest.approx(1 - 2 / 4, abs=0.03)  # most calls are short


def test_grouped_and_per_trajectory_requests_share_a_length():
    assert pipeline.length_key("solver/arith-7-3_0_*") == pipeline.length_key("solver/arith-7-3_0_2")
    assert pipeline.length_key("solver/arith-7-3_0_*") != pipeline.length_key("verifier/arith-7-3_1_*")


class FakeBackend:
    def __init__(self):
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        future = concurrent.futures.Future()
        future.set_result([Completion(text="xyz", prompt_token_ids=(1,), token_ids=(5, 6), logprobs=(-1.0, -2.0),
                                      finish_reason="length", policy_version=0)] * request.num_samples)
        return future


def _request(agent, request_id, samples=1):
    return GenerationRequest(request_id=request_id, agent=agent, prompt="1+1=", num_samples=samples,
                             sampling=SamplingParams(max_new_tokens=99))


def test_workload_backend_sets_lengths_and_seeded_verdicts():
    inner = FakeBackend()
    workload = dataclasses.replace(pipeline.FULL, reject_rate=0.3)
    backend = pipeline.WorkloadBackend(inner, workload, seed=0, verdict_agent="verifier", reject_rate=0.3)
    solver = backend.submit(_request("solver", "solver/q1_0_*", samples=4)).result()
    assert [c.text for c in solver] == ["xyz"] * 4  # only the verdict agent's text changes
    assert inner.requests[-1].sampling.max_new_tokens == backend.length_for("solver/q1_0_0")
    verdicts = []
    for query in range(500):
        completions = backend.submit(_request("verifier", f"verifier/q{query}_1_0")).result()
        (completion,) = completions
        assert completion.token_ids == (5, 6) and completion.logprobs == (-1.0, -2.0)
        assert completion.text.endswith("\nxyz")
        verdicts.append(completion.text.split("\n")[0])
        assert workload.tail_min_length <= inner.requests[-1].sampling.max_new_tokens <= workload.max_response_length
    assert set(verdicts) == {"Y", "N"}
    assert verdicts.count("N") / len(verdicts) == pytest.approx(0.3, abs=0.06)
    again = backend.submit(_request("verifier", "verifier/q0_1_0")).result()[0].text.split("\n")[0]
    assert again == verdicts[0]


class FakeStore:
    """Claims fail until a row was appended; every call advances a fake clock by exactly 1.0."""

    def __init__(self):
        self.now = 0.0
        self.rows = 0

    def clock(self):
        return self.now

    def append_rows(self, agent, **kwargs):
        self.now += 1.0
        self.rows += 1
        return [f"{agent}-{self.rows}"]

    def wake_claims(self):
        pass

    def claim_micro_batch(self, agent, size, *, timeout=0.0, **kwargs):
        assert timeout == 0 and "until" not in kwargs  # the proxy never blocks inside the store
        self.now += 1.0
        if self.rows == 0:
            return None
        self.rows -= 1
        return ("batch", agent, size)


@pytest.mark.timeout(30)
def test_timed_store_counts_store_work_but_not_waiting_for_rows():
    store = FakeStore()
    timed = pipeline.TimedStore(store, clock=store.clock)
    claimed = []
    started = time.monotonic()
    waiter = threading.Thread(target=lambda: claimed.append(timed.claim_micro_batch("solver", 4, timeout=20.0)))
    waiter.start()
    time.sleep(0.3)
    timed.append_rows("solver", input_ids=["q"])
    waiter.join()
    assert claimed == [("batch", "solver", 4)]
    assert time.monotonic() - started >= 0.3  # the claim did wait for the append
    counts = {name: totals[0] for name, totals in timed.calls.items()}
    assert counts["append_rows"] == 1
    # Two or three claim attempts (before the append, maybe one spurious, after it), each 1.0 on the clock.
    assert counts["claim_micro_batch"] in (2, 3)
    assert timed.summed_seconds(-1, 1e9) == pytest.approx(1.0 + counts["claim_micro_batch"])
    assert timed.busy_seconds(-1, 1e9) <= timed.summed_seconds(-1, 1e9)
    assert timed.claim_micro_batch("solver", 4, timeout=0.05) is None  # nothing left: gives up at timeout


def test_device_utilization_unions_resources_on_one_device():
    from flexmarl_jax.metrics import Timeline

    timeline = Timeline(clock=lambda: 0.0)
    timeline.add_interval("rollout/instance0", 0.0, 4.0)
    timeline.add_interval("train/solver", 2.0, 6.0)  # same device as instance0 (colocated): union [0, 6]
    timeline.add_interval("train/verifier", 0.0, 1.0)  # its own device
    devices = {"rollout/instance0": (0,), "train/solver": (0,), "train/verifier": (1,), "rollout/instance1": (2,)}
    # device 0: 6 of 10 s, device 1: 1 of 10 s, device 2: idle.
    assert pipeline.device_utilization(timeline, devices, 0.0, 10.0) == pytest.approx((6 + 1 + 0) / 30)


def test_summarize_ratios_and_goals():
    modes = {name: {"e2e_s": e2e, "store_time_fraction": 0.01} for name, e2e in
             (("serial", 6.0), ("sync", 2.2), ("flexmarl", 2.0), ("flexmarl_no_async", 2.1))}
    result = pipeline.summarize(modes)
    assert result["speedup_vs_serial"] == pytest.approx(3.0)
    assert result["speedup_vs_sync"] == pytest.approx(1.1)
    assert result["modes"]["sync"]["speedup_vs_serial"] == pytest.approx(6.0 / 2.2)
    assert result["goals_met"] == {"speedup_vs_serial": True, "speedup_vs_sync": False, "store_time_fraction": True}


@pytest.mark.timeout(900)
def test_quick_bench_runs_every_mode_on_the_same_workload(tmp_path):
    path = tmp_path / "pipeline.json"
    assert pipeline.main(["--quick", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert list(result["modes"]) == list(pipeline.MODES)
    for name, numbers in result["modes"].items():
        assert numbers["e2e_s"] > 0 and numbers["tokens_per_s"] > 0, name
        assert 0 < numbers["utilization"] <= 1, name
        assert all(0 <= value <= 1 for value in numbers["utilization_by_group"].values()), name
        assert 0 <= numbers["store_time_fraction"] < 1, name
        for iteration in numbers["iterations"]:
            assert sum(iteration["split"].values()) == pytest.approx(iteration["e2e_s"], rel=1e-6)
            assert iteration["generated_tokens"] > 0 and 0 <= iteration["compile_s"]
        # Steady iterations only: the E2E is the median of those counted, the others are listed as left out.
        counted = [it for it in numbers["iterations"] if it["counted"]]
        left_out = [it["iteration"] for it in numbers["iterations"] if not it["counted"]]
        assert counted and numbers["left_out"]["iterations"] == left_out, name
        assert numbers["e2e_s"] == pytest.approx(statistics.median(it["e2e_s"] for it in counted)), name
        assert numbers["left_out"]["compile_s"] == pytest.approx(
            sum(it["compile_s"] for it in numbers["iterations"] if not it["counted"])), name
        assert numbers["speedup_vs_serial"] == pytest.approx(result["modes"]["serial"]["e2e_s"] / numbers["e2e_s"])
    modes = result["modes"]
    assert result["speedup_vs_serial"] == pytest.approx(modes["serial"]["e2e_s"] / modes["flexmarl"]["e2e_s"])
    assert result["speedup_vs_sync"] == pytest.approx(modes["sync"]["e2e_s"] / modes["flexmarl"]["e2e_s"])
    assert result["store_time_fraction"] == modes["flexmarl"]["store_time_fraction"]
    # The same workload everywhere: the seeded verdicts give every mode the same verifier and corrector calls
    # (the solver's count differs: serial sends a query's samples one by one, the others as one request).
    for agent in ("verifier", "corrector"):
        counts = {name: [it["requests"][agent] for it in numbers["iterations"]] for name, numbers in modes.items()}
        assert len({tuple(c) for c in counts.values()}) == 1, (agent, counts)
    assert modes["flexmarl"]["iterations"][0]["requests"]["verifier"] == pipeline.QUICK.global_batch_size


@pytest.mark.timeout(30)
def test_timed_store_claim_ends_on_until_and_wake_without_claiming_again():
    store = FakeStore()
    timed = pipeline.TimedStore(store, clock=store.clock)
    done, results = threading.Event(), []
    waiter = threading.Thread(target=lambda: results.append(
        timed.claim_micro_batch("solver", 4, timeout=None, until=done)))
    waiter.start()
    timed.append_rows("verifier", input_ids=["v"])  # another agent's rows: the solver's claim keeps waiting
    time.sleep(0.2)
    assert waiter.is_alive()
    done.set()
    timed.wake_claims()
    waiter.join(timeout=5)
    assert results == [None]
    assert timed.calls["claim_micro_batch"][0] == 1  # one attempt: neither the append nor the wake re-claims
