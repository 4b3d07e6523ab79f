"""MetricsWriter: JSONL round trip of numpy/JAX values, resume dedupe, torn lines, TensorBoard tags."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from flexmarl_jax import metrics


def read_tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Parse every TFRecord event file under `logdir`: `{tag: {step: value}}`."""
    scalars: dict[str, dict[int, float]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12 : offset + 12 + length]  # 8 length + 4 length-crc
            offset += 12 + length + 4  # + 4 payload-crc
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
        assert offset == len(data), f"{path} has trailing bytes: not a complete TFRecord file"
    return scalars


def test_jsonl_round_trip_converts_numpy_and_jax_values(tmp_path):
    record = {
        "iteration": np.int64(0),
        "team_accuracy": np.float32(0.25),
        "e2e_s": jnp.float32(1.5),
        "tokens_per_s": jnp.array(812.0),
        "lengths": np.array([3, 4, 5], dtype=np.int32),
        "kl": float("nan"),
        "done": np.bool_(True),
        "loss_bf16": jnp.array(0.5, dtype=jnp.bfloat16),
        "mode": "flexmarl",
        "agent": {"solver": {"reward": np.float64(0.75), "clip_frac": jnp.float32(0.125)}},
    }
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        assert writer.write(record) is True
    lines = (tmp_path / metrics.METRICS_FILENAME).read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {
        "iteration": 0,
        "team_accuracy": 0.25,
        "e2e_s": 1.5,
        "tokens_per_s": 812.0,
        "lengths": [3, 4, 5],
        "kl": None,  # NaN is not JSON
        "done": True,
        "loss_bf16": 0.5,
        "mode": "flexmarl",
        "agent": {"solver": {"reward": 0.75, "clip_frac": 0.125}},
    }
    assert metrics.read_metrics(tmp_path) == [json.loads(lines[0])]
    assert metrics.flatten(json.loads(lines[0]))["agent/solver/reward"] == 0.75


def test_resume_does_not_duplicate_iterations(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        assert writer.last_iteration is None
        for iteration in range(3):
            assert writer.write({"iteration": iteration, "team_accuracy": 0.1 * iteration})
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as resumed:
        assert resumed.last_iteration == 2
        assert resumed.has_iteration(1) and not resumed.has_iteration(3)
        assert resumed.write({"iteration": 2, "team_accuracy": 0.99}) is False  # repeated after a crash
        assert resumed.write({"iteration": 3, "team_accuracy": 0.3}) is True
        assert [r["iteration"] for r in resumed.records] == [0, 1, 2, 3]
    records = metrics.read_metrics(tmp_path / metrics.METRICS_FILENAME)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert records[2]["team_accuracy"] == pytest.approx(0.2)  # the first record of iteration 2 is kept


def test_torn_last_line_is_dropped_before_appending(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write({"iteration": 0, "team_accuracy": 0.1})
        writer.write({"iteration": 1, "team_accuracy": 0.2})
    with open(tmp_path / metrics.METRICS_FILENAME, "a") as file:
        file.write('{"iteration": 2, "team_acc')  # SIGKILL in the middle of a write
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as resumed:
        assert resumed.last_iteration == 1
        assert resumed.write({"iteration": 2, "team_accuracy": 0.3})
    lines = (tmp_path / metrics.METRICS_FILENAME).read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]


def test_record_without_integer_iteration_is_rejected(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="needs an integer 'iteration', got None"):
            writer.write({"team_accuracy": 0.5})
        with pytest.raises(ValueError, match="got 1.5"):
            writer.write({"iteration": 1.5})
        with pytest.raises(TypeError, match="not JSON-serialisable"):
            writer.write({"iteration": 0, "weird": object()})
    assert not (tmp_path / metrics.METRICS_FILENAME).exists() or metrics.read_metrics(tmp_path) == []


def test_tensorboard_event_files_hold_flattened_tags(tmp_path, synthetic_records):
    with metrics.MetricsWriter(tmp_path) as writer:
        for record in synthetic_records[:4]:
            writer.write(record)
    scalars = read_tensorboard_scalars(tmp_path / metrics.TENSORBOARD_DIRNAME)
    for tag in (
        "team_accuracy",
        "e2e_s",
        "tokens_per_s",
        "utilization/rollout",
        "agent/solver/reward",
        "agent/planner/kl",
        "utilization/resources/rollout/instance0",
    ):
        assert sorted(scalars[tag]) == [0, 1, 2, 3], tag
    assert "iteration" not in scalars
    for record in synthetic_records[:4]:
        step = record["iteration"]
        assert scalars["team_accuracy"][step] == pytest.approx(float(record["team_accuracy"]), rel=1e-6)
        assert scalars["agent/solver/reward"][step] == pytest.approx(
            float(record["agent"]["solver"]["reward"]), rel=1e-6
        )


@pytest.mark.timeout(60)
def test_concurrent_writers_threads_write_each_iteration_once(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        results: list[bool] = []
        lock = threading.Lock()

        def work(offset: int) -> None:
            for iteration in range(40):
                written = writer.write({"iteration": iteration, "writer": offset})
                with lock:
                    results.append(written)

        threads = [threading.Thread(target=work, args=(offset,)) for offset in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results.count(True) == 40
    records = metrics.read_metrics(tmp_path)
    assert sorted(record["iteration"] for record in records) == list(range(40))


def _eval_record(step: int, accuracy: float) -> dict:
    return {"kind": metrics.EVAL_KIND, "iteration": step, "policy_version": {"solver": step},
            "eval_team_accuracy": accuracy, "eval_pass_at_k": min(1.0, 2 * accuracy),
            "agent": {"solver": {"eval_accuracy": accuracy}}}


def test_eval_records_are_their_own_kind(tmp_path):
    with metrics.MetricsWriter(tmp_path) as writer:
        assert writer.write(_eval_record(0, 0.1))
        for iteration in range(3):
            assert writer.write({"iteration": iteration, "team_accuracy": 0.2 * iteration,
                                 "policy_version": {"solver": iteration}})
        assert writer.write(_eval_record(3, 0.4))
        assert not writer.write(_eval_record(3, 0.9))  # one eval per step, as one record per iteration
        assert writer.last_iteration == 2  # an eval record is not a trained iteration
        assert writer.has_iteration(3, kind=metrics.EVAL_KIND) and not writer.has_iteration(3)
    records = metrics.read_metrics(tmp_path)
    assert [r["iteration"] for r in metrics.iteration_records(records)] == [0, 1, 2]
    assert [(r["iteration"], r["eval_team_accuracy"]) for r in metrics.eval_records(records)] == [(0, 0.1), (3, 0.4)]
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as resumed:  # a resumed run sees both kinds
        assert resumed.has_iteration(0, kind=metrics.EVAL_KIND) and resumed.last_iteration == 2
    scalars = read_tensorboard_scalars(tmp_path / metrics.TENSORBOARD_DIRNAME)
    assert scalars["eval_team_accuracy"] == {0: pytest.approx(0.1), 3: pytest.approx(0.4)}
    assert scalars["agent/solver/eval_accuracy"] == {0: pytest.approx(0.1), 3: pytest.approx(0.4)}
    # An eval record adds only its eval metrics: policy_version/solver keeps one value per trained iteration.
    assert sorted(scalars["policy_version/solver"]) == [0, 1, 2]


def test_forget_from_removes_the_records_of_redone_iterations_and_of_discarded_policies(tmp_path):
    from flexmarl_jax.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(3):
        writer.write({"iteration": step, "team_accuracy": 0.1 * step})
        writer.write({"kind": "eval", "iteration": step + 1, "eval": {"greedy_accuracy": 0.5}})
    assert writer.forget_from(2) == 2  # iteration 2 is redone; the eval of version 3 evaluated its update
    assert [(r.get("kind", "iteration"), r["iteration"]) for r in read_metrics(tmp_path)] == [
        ("iteration", 0), ("eval", 1), ("iteration", 1), ("eval", 2)]
    assert writer.write({"iteration": 2, "team_accuracy": 0.9})  # the redone iteration's record is written
    assert MetricsWriter(tmp_path, tensorboard=False).has_iteration(2)
