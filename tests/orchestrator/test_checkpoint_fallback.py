"""A newest checkpoint that fails verification: the resume reports it, every agent goes back to the previous
intact version, and — counted from the store itself — no row is lost or trained twice: the rows the discarded
update trained are dropped, and the redone iteration trains a batch of fresh rows once."""

import glob
import os
import shutil

import numpy as np
import pytest

from flexmarl_jax import metrics
from flexmarl_jax.metrics import MetricsWriter, read_metrics
from flexmarl_jax.orchestrator.journal import TRAINED_DIR, RunJournal
from flexmarl_jax.orchestrator.resume import NoIntactCheckpoint, prepare_resume
from flexmarl_jax.orchestrator.run import _begin_attempt, _checkpoint
from flexmarl_jax.store import RowState
from flexmarl_jax.train.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_versions,
    restore_trainer,
    save_all,
    save_trainer,
    verify_checkpoint,
)
from tests.orchestrator.conftest import AGENTS


def _run(orchestrator, workdir, iterations, writer):
    """The iteration loop of `run._run_locked` (journal, checkpoint before consume, metrics), over a scripted
    rollout; returns each iteration's record."""
    journal = RunJournal(workdir)
    orchestrator.on_update_applied = lambda iteration, record, trained: _checkpoint(
        orchestrator.trainers, workdir, journal, record, trained)
    records = {}
    for iteration in iterations:
        _begin_attempt(orchestrator, journal, iteration, durable=True)
        records[iteration] = orchestrator.run_iteration(iteration)
        writer.write(records[iteration])
        journal.iteration_logged()
    return records


def _corrupt_a_data_file(step_dir, seed):
    rng = np.random.default_rng(seed)
    data_files = sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True))
    path = data_files[rng.integers(len(data_files))]
    position = int(rng.integers(os.path.getsize(path) - 8))
    with open(path, "r+b") as handle:
        handle.seek(position)
        before = handle.read(8)
        handle.seek(position)
        handle.write(bytes(b ^ 0xA5 for b in before))
    return os.path.relpath(path, step_dir)


def _rows_by_version(store, agent):
    """{own policy version: {state: [sample ids]}} of every row of the agent's table."""
    rows = store.read_rows(agent, columns=["reward"])
    out = {}
    for sample_id, state, version in zip(rows["sample_id"], rows["state"].tolist(),
                                         rows["policy_versions"][agent].tolist(), strict=True):
        out.setdefault(version, {}).setdefault(RowState(state), []).append(sample_id)
    return out


@pytest.mark.timeout(300)
def test_a_corrupted_newest_checkpoint_resumes_from_the_previous_version_with_no_row_lost_or_trained_twice(
        orchestrator_factory, tmp_path, caplog):
    workdir = str(tmp_path)
    root = os.path.join(workdir, CHECKPOINT_DIR)
    first, _ = orchestrator_factory(workdir=workdir, backend="file")
    first_records = _run(first, workdir, range(3), MetricsWriter(workdir, tensorboard=False))
    first.store.close()
    assert {agent: checkpoint_versions(os.path.join(root, agent)) for agent in AGENTS} == {a: [2, 3] for a in AGENTS}
    damaged = _corrupt_a_data_file(os.path.join(root, "verifier", "3"), seed=7)

    second, _ = orchestrator_factory(workdir=workdir, backend="file")
    resumed = prepare_resume(root, AGENTS)
    assert resumed.version == 2 and list(resumed.rejected) == [3]
    assert "agent 'verifier'" in resumed.rejected[3] and damaged in resumed.rejected[3]
    assert "policy version 3 cannot be resumed from" in caplog.text
    # Every agent's version 3 is gone (the intact ones too): all agents resume from the same version.
    assert {agent: checkpoint_versions(os.path.join(root, agent)) for agent in AGENTS} == {a: [2] for a in AGENTS}
    for agent, trainer in second.trainers.items():
        restore_trainer(trainer, os.path.join(root, agent), policy_version=2, verify=False)
    second.sync_all()
    writer = MetricsWriter(workdir, tensorboard=False)
    RunJournal(workdir).settle(second.store, writer, start=2)
    redone = _run(second, workdir, [2], writer)[2]
    assert second.versions() == {agent: 3 for agent in AGENTS}
    for agent in AGENTS:
        verify_checkpoint(os.path.join(root, agent), 3)  # the redone iteration's checkpoint, intact

    # Counted from the store: each policy version of each agent trained one batch, once.
    surviving = {0: first_records[0], 1: first_records[1], 2: redone}
    for agent in AGENTS:
        rows = _rows_by_version(second.store, agent)
        assert set(rows) == {0, 1, 2}
        for version, record in surviving.items():
            by_state = rows[version]
            assert set(by_state) <= {RowState.CONSUMED, RowState.DROPPED}, (agent, version, by_state.keys())
            consumed = by_state[RowState.CONSUMED]
            assert len(consumed) == record["agent"][agent]["samples"] > 0, (agent, version)
            assert len(set(consumed)) == len(consumed)
        # The discarded update's rows (iteration 2, first attempt) are dropped, none of them consumed; the
        # redone iteration consumed only rows of its own attempt (input ids with the attempt suffix).
        dropped = rows[2][RowState.DROPPED]
        assert len(dropped) == first_records[2]["agent"][agent]["samples"], agent
        assert all("r1_" in sample_id for sample_id in rows[2][RowState.CONSUMED]), agent
        assert not any("r1_" in sample_id for sample_id in dropped), agent
        assert RowState.DROPPED not in rows[0] and RowState.DROPPED not in rows[1]
    assert sorted(os.listdir(os.path.join(workdir, TRAINED_DIR))) == ["1.json", "2.json"]
    # metrics.jsonl holds one record per iteration, the redone one's for iteration 2 (not the discarded one's).
    records = [r for r in read_metrics(workdir) if r.get("kind", "iteration") == "iteration"]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert records[2]["agent"] == metrics.to_jsonable(redone)["agent"]


@pytest.mark.timeout(300)
def test_a_first_save_cut_between_agents_is_deleted_and_the_run_starts_over(orchestrator_factory, tmp_path, caplog):
    """A run stopped between agents' saves of version 0 (the warm-up's): one agent holds it, the others not.
    Before the fix the resume saw no common version, started fresh and died in Orbax's StepAlreadyExistsError
    when it saved version 0 again."""
    workdir = str(tmp_path)
    root = os.path.join(workdir, CHECKPOINT_DIR)
    orchestrator, _ = orchestrator_factory(workdir=workdir, backend="file")
    first = AGENTS[0]
    save_trainer(orchestrator.trainers[first], os.path.join(root, first))
    assert checkpoint_versions(os.path.join(root, first)) == [0]
    assert prepare_resume(root, AGENTS) is None  # nothing to resume from: a fresh start
    assert "cut between agents" in caplog.text
    assert checkpoint_versions(os.path.join(root, first)) == []
    assert save_all(orchestrator.trainers, root) == {agent: 0 for agent in AGENTS}  # the fresh start's save


@pytest.mark.timeout(300)
def test_agents_holding_different_versions_are_refused_and_nothing_deleted(orchestrator_factory, tmp_path):
    workdir = str(tmp_path)
    root = os.path.join(workdir, CHECKPOINT_DIR)
    orchestrator, _ = orchestrator_factory(workdir=workdir, backend="file")
    save_all(orchestrator.trainers, root)
    shutil.move(os.path.join(root, AGENTS[1], "0"), os.path.join(root, AGENTS[1], "5"))  # not this run's doing
    with pytest.raises(NoIntactCheckpoint, match=f"{AGENTS[1]} has \\[5\\]"):
        prepare_resume(root, AGENTS)
    assert checkpoint_versions(os.path.join(root, AGENTS[0])) == [0]
    assert checkpoint_versions(os.path.join(root, AGENTS[1])) == [5]


@pytest.mark.timeout(300)
def test_a_first_save_without_its_last_manifest_is_deleted_and_the_run_starts_over(orchestrator_factory, tmp_path,
                                                                                    caplog):
    """Killed after Orbax finalized the last agent's version 0 but before its manifest: every agent holds the
    version, one fails verification, and there is nothing older to fall back to."""
    workdir = str(tmp_path)
    root = os.path.join(workdir, CHECKPOINT_DIR)
    orchestrator, _ = orchestrator_factory(workdir=workdir, backend="file")
    save_all(orchestrator.trainers, root)
    os.remove(os.path.join(root, AGENTS[-1], "0", "integrity.json"))
    assert prepare_resume(root, AGENTS) is None
    assert "only checkpoint version 0 is not intact" in caplog.text and "has no integrity.json" in caplog.text
    assert all(checkpoint_versions(os.path.join(root, agent)) == [] for agent in AGENTS)
