"""A store value that changed on disk fails its rows loudly at the claim (an error naming the agent and the
rows) and never reaches a trainer; the intact groups before it train as usual."""

import os
import threading

import numpy as np
import pytest
import tensorstore as ts

from flexmarl_jax.orchestrator.dispatch import DispatchStats
from flexmarl_jax.store import ExperienceStore, StoreCorrupted
from tests.orchestrator.conftest import AGENTS, MAX_PROMPT, MICRO_BATCH, SAMPLES

GROUPS = 4


def _blob_locations(store_dir, column):
    """(data file, offset, length) of each stored blob of the solver's `column`, in blob id order."""
    kv = ts.KvStore.open({"driver": "file", "path": store_dir + "/"}).result()
    root = ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]
    found = []
    for entry in ts.ocdbt.dump(kv, root).result()["entries"]:  # one leaf: the store here is small
        key = bytes(entry["key"]).decode()
        if key.startswith(f"tables/solver/blobs/{column}/") and "indirect_value" in entry:
            _, _, path, offset, length = entry["indirect_value"].split(":")
            found.append((key, path, int(offset), int(length)))
    return [location for _, *location in sorted(found)]


@pytest.mark.timeout(300)
def test_a_corrupted_value_fails_its_rows_and_is_never_passed_to_a_trainer(orchestrator_factory, tmp_path):
    workdir = str(tmp_path)
    rng = np.random.default_rng(0)
    writer = ExperienceStore.open(workdir, agents=AGENTS, backend="file")
    for group in range(GROUPS):  # one append (one blob per sequence column) per group
        writer.append_rows("solver", input_ids=[f"q{group}"] * SAMPLES, trajectory_ids=range(SAMPLES),
                           group_size=SAMPLES, policy_versions={"solver": 0},
                           columns={"reward": rng.random(SAMPLES).astype(np.float32),
                                    "advantage": rng.standard_normal(SAMPLES).astype(np.float32),
                                    "prompt_tokens": [rng.integers(3, 90, MAX_PROMPT) for _ in range(SAMPLES)],
                                    "response_tokens": [rng.integers(3, 90, 6) for _ in range(SAMPLES)],
                                    "behaviour_logprobs": [-rng.random(6).astype(np.float32) - 1.0
                                                           for _ in range(SAMPLES)]})
    writer.close()
    path, offset, length = _blob_locations(os.path.join(workdir, "store"), "prompt_tokens")[2]  # group q2
    with open(os.path.join(workdir, "store", path), "r+b") as handle:
        handle.seek(offset + 5)  # inside the first row's prompt
        handle.write(b"\x7f\x7f\x7f\x7f")

    orchestrator, _ = orchestrator_factory()
    orchestrator.store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    trained = []
    dispatcher = orchestrator._dispatchers()["solver"]
    dispatcher.on_trained = lambda sample_ids, agent, versions: trained.extend(sample_ids)
    done = threading.Event()
    done.set()
    with pytest.raises(StoreCorrupted, match=r"table of agent 'solver'; rows 'q2_0_0'"):
        dispatcher.drain({agent: 0 for agent in AGENTS}, done, DispatchStats(), iteration_start=0.0)
    assert trained == [f"q{g}_0_{t}" for g in (0, 1) for t in range(SAMPLES)]  # one micro-batch: q0 and q1
    assert dispatcher.trainer.pending_micro_batches == len(trained) // MICRO_BATCH == 1
    assert orchestrator.store.counters("solver")["dropped"] == SAMPLES  # q2's group: failed, never trained
