"""Checkpoint checksums: random bytes written into a data file of a finished checkpoint are detected before
anything is restored, in 10 of 10 trials; a save that never wrote its manifest is refused too."""

import glob
import os
import shutil

import numpy as np
import pytest

from flexmarl_jax.train.checkpoint import restore_policy, restore_trainer, save_trainer, verify_checkpoint
from flexmarl_jax.train.checkpoint_integrity import MANIFEST, CheckpointCorrupted
from tests.corruption import overwrite_with_noise
from tests.train.conftest import make_trainer, random_rows, run_iteration

MICRO = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model_config, initial):
    """One agent's checkpoint of policy version 1 (params, Adam moments, reference), and its trainer."""
    root = tmp_path_factory.mktemp("checkpoint")
    trainer = make_trainer(tiny_model_config, initial, MICRO)
    run_iteration(trainer, random_rows(8, seed=3), MICRO)
    trainer.apply()
    save_trainer(trainer, root / "solver")
    return root, trainer


def test_random_bytes_in_a_checkpoint_data_file_are_detected_in_10_of_10_trials(saved, tiny_model_config, initial,
                                                                                tmp_path):
    root, _ = saved
    verify_checkpoint(root / "solver", 1)  # the untouched checkpoint passes
    fresh = make_trainer(tiny_model_config, initial, MICRO)
    for trial in range(10):
        rng = np.random.default_rng(trial)
        copy = tmp_path / f"trial{trial}"
        shutil.copytree(root, copy)
        data_files = sorted(glob.glob(str(copy / "solver" / "1" / "state" / "**" / "d" / "*"), recursive=True))
        assert len(data_files) >= 2
        path = data_files[rng.integers(len(data_files))]
        size = min(16, os.path.getsize(path))
        position = int(rng.integers(os.path.getsize(path) - size + 1))
        overwrite_with_noise(path, position, size, rng)
        with pytest.raises(CheckpointCorrupted, match=os.path.relpath(path, copy / "solver" / "1")):
            restore_trainer(fresh, copy / "solver")
        with pytest.raises(CheckpointCorrupted):
            restore_policy(copy / "solver")
        assert fresh.policy_version == 0  # nothing of the damaged checkpoint was loaded


def test_a_step_without_its_manifest_is_an_unfinished_save(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root, tmp_path / "copy")
    os.remove(tmp_path / "copy" / "solver" / "1" / MANIFEST)
    with pytest.raises(CheckpointCorrupted, match="has no integrity.json: its save did not finish"):
        verify_checkpoint(tmp_path / "copy" / "solver", 1)
    shutil.copytree(root, tmp_path / "extra")
    (tmp_path / "extra" / "solver" / "1" / "state" / "stray").write_bytes(b"x")
    with pytest.raises(CheckpointCorrupted, match="state/stray was not saved with it"):
        verify_checkpoint(tmp_path / "extra" / "solver", 1)
