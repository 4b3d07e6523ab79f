"""Two local processes x 4 fake CPU devices (gloo) train 2 iterations of the smoke config on a `file://` workdir,
with every agent's rollout instances on both "hosts" and the shared training slice spanning both, and end with
the parameters of one process x 8 devices. Each file of the workdir has one writer.

Overrides (both runs): `pipeline.deterministic=True`, `rollout.instances_per_agent=2` (one instance of every
agent on each process), `mesh.train_slices=1` with `mesh.train_devices_per_agent=2` (the one training slice:
a device of each process), `store.backend=file`, `eval.enabled=False`, and as the task a JSONL file of prompts
whose answers are one digit (`workflow.task=<tmp>/digits.jsonl`, the numeric verifier).

What the equality covers: the smoke warm-up's 2 supervised steps of every agent on the spanning slice, both RL
iterations (rollouts sampled on both processes' engines, the rewards, the store, the micro-batches and the
updates on the spanning slice), the Orbax checkpoints both processes write, each agent's state offloaded to
host as local shards and put back, and the weight syncs from the slice to both processes' engines. Why the digit
task: on the smoke config's own task (reverse) the tiny models earn no reward in 2 iterations, so every
advantage, and so every RL update, is zero; a sampled first number is a right digit often enough that the
solver's and verifier's groups differ in reward, and both iterations update both (checked below). The corrector
runs only when the verifier rejects an answer, which the tiny verifier never does here, so it shares only the
warm-up. (With `workflow.options.corrector_runs=always` the final answer is the corrector's, never right here,
and the verifier's reward is then zero too.)"""

import json
import os
import stat
from pathlib import Path

import jax
import numpy as np
import pytest

from flexmarl_jax.cli.main import main
from flexmarl_jax.train.checkpoint import restore_policy
from tests.distributed import all_device_watch, processes

AGENTS = ("solver", "verifier", "corrector")
OVERRIDES = ["--config=configs/tiny.py:smoke", "--config.pipeline.deterministic=True",
             "--config.rollout.instances_per_agent=2", "--config.mesh.train_slices=1",
             "--config.mesh.train_devices_per_agent=2", "--config.store.backend=file", "--config.eval.enabled=False"]
UMASKS = ("022", "077")  # process 0 creates files rw-r--r--, process 1 rw-------


def distributed_flags(port: int, process_id: int) -> list[str]:
    return ["--config.distributed.enabled=True", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={process_id}",
            "--config.mesh.fake_cpu_devices=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_process")
    ledgers = [root / f"writes{index}.txt" for index in range(2)]
    child = str(processes.REPO / "tests" / "distributed" / "train_child.py")
    task = root / "digits.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"n{index}", "answer": str(index % 3 + 1)}) + "\n"
                            for index in range(24)))
    overrides = [*OVERRIDES, f"--config.workflow.task={task}"]
    workdir = root / "run"
    port = processes.free_port()
    results = processes.wait_all(processes.start(
        lambda index: [child, str(ledgers[index]), UMASKS[index], "train", *overrides, f"--workdir=file://{workdir}",
                       *distributed_flags(port, index)], 2, devices_per_process=4), timeout=840)
    for index, (code, _, err) in enumerate(results):
        assert code == 0, f"process {index}: {err[-4000:]}"
    reference = root / "reference"
    assert main(["train", *overrides, f"--workdir=file://{reference}"]) == 0  # this process: 1 x 8 devices
    return workdir, reference, ledgers, [err for _, _, err in results]


def _tolerance(reference: np.ndarray) -> dict[str, float]:
    """The equality's tolerance against `reference`: 1e-4 relative, and an absolute floor for entries near 0."""
    return {"rtol": 1e-4, "atol": 1e-6 * float(np.max(np.abs(reference)))}


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _policy(workdir: Path, agent: str, version: int) -> list[np.ndarray]:
    policy = restore_policy(workdir / "checkpoints" / agent, version)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(policy.params)]


@pytest.mark.timeout(900)
def test_two_processes_end_with_the_parameters_of_one(runs):
    workdir, reference, _, _ = runs
    for agent in AGENTS:
        ours, theirs = _policy(workdir, agent, 2), _policy(reference, agent, 2)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, **_tolerance(b), err_msg=agent)
    records = _metrics(workdir)
    assert [record["iteration"] for record in records] == [0, 1]  # one writer: each record once
    assert all(record["agent"]["solver"]["micro_batches"] == 2 for record in records)


@pytest.mark.timeout(900)
def test_the_equality_covers_rl_updates(runs):
    """Both iterations update the solver and the verifier (the corrector gets no work: see the module
    docstring): nonzero gradients, and iteration 1's update moves every parameter leaf by more than the
    equality's tolerance (so equal parameters mean equal RL)."""
    workdir, _, _, _ = runs
    records = _metrics(workdir)
    for agent in ("solver", "verifier"):
        assert all(record["agent"][agent]["grad_norm"] > 0 for record in records), agent
        before, after = _policy(workdir, agent, 1), _policy(workdir, agent, 2)
        for a, b in zip(before, after, strict=True):
            assert not np.allclose(a, b, **_tolerance(b)), agent


def _creator(path: Path) -> int:
    """The process whose umask the file's mode bits carry (process 1's umask leaves no group/other bits)."""
    return 1 if stat.S_IMODE(path.stat().st_mode) & 0o077 == 0 else 0


@pytest.mark.timeout(900)
def test_every_file_of_the_workdir_has_one_writer(runs):
    workdir, _, ledgers, _ = runs
    written = [set(line for line in ledger.read_text().splitlines() if line.startswith(str(workdir) + os.sep))
               for ledger in ledgers]
    files = sorted(path for path in workdir.rglob("*") if path.is_file())
    writers = {}
    for path in files:
        who = {_creator(path)} | {index for index in range(2) if str(path) in written[index]}
        assert len(who) == 1, f"{path.relative_to(workdir)} has writers {sorted(who)}"
        writers[str(path.relative_to(workdir))] = who.pop()
    assert not (written[0] & written[1]), f"written by both: {sorted(written[0] & written[1])[:5]}"
    by_process_1 = sorted(name for name, who in writers.items() if who == 1)
    # Process 1 writes its own lock and, through Orbax's multi-process API, its own shards of each checkpoint.
    assert "run.process1.lock" in by_process_1
    assert all(name == "run.process1.lock" or "process_1" in name for name in by_process_1), by_process_1
    assert any("ocdbt.process_1" in name for name in by_process_1)
    for name in ("config.json", "metrics.jsonl", "timeline.json", "attempts.json", "plots/curves.png",
                 "store/manifest.ocdbt", "run.lock"):
        assert writers[name] == 0, name


@pytest.mark.timeout(900)
def test_no_computation_spans_every_device(runs):
    """Neither process started a computation over every device (all_device_watch): the micro-batches, the
    initial parameters and the state put back from host are placed shard by shard (`across_processes.put`),
    and Orbax's barriers and `leader_value` go through the runtime's key-value service. One such computation
    per placed micro-batch made about one 2-process run in seven abort in gloo (transfer/across_processes.py)."""
    _, _, _, errs = runs
    for index, err in enumerate(errs):
        reported = [line for line in err.splitlines() if line.startswith(all_device_watch.MARK)]
        assert reported == [], f"process {index}: {reported[:5]}"
