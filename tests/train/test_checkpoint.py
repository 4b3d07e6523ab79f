"""Orbax checkpoints: save -> restore (also onto another mesh shape) -> continue == uninterrupted run."""

import dataclasses

import jax
import numpy as np
import pytest

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.train.checkpoint import flatten_to_names, restore_all, restore_trainer, save_all, save_trainer
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import trainer_config
from tests.train.conftest import ADAM, LOSS, MAX_LEN, make_trainer, random_rows, rel_err, run_iteration

MICRO = 8


def test_restore_onto_other_mesh_then_continue_equals_uninterrupted(tiny_model_config, initial, tmp_path):
    first, second = random_rows(16, seed=11), random_rows(16, seed=12)
    mesh_a = make_mesh(jax.devices()[:8], fsdp=8)
    mesh_b = make_mesh(jax.devices()[:8], fsdp=4, tp=2)

    uninterrupted = make_trainer(tiny_model_config, initial, MICRO, mesh=mesh_a)
    run_iteration(uninterrupted, first, MICRO)
    uninterrupted.apply()
    assert save_trainer(uninterrupted, tmp_path / "solver") == 1
    run_iteration(uninterrupted, second, MICRO)
    uninterrupted.apply()

    for mesh in (mesh_a, mesh_b, None):  # same shape, fsdp x tp, one device
        resumed = make_trainer(tiny_model_config, initial, MICRO, mesh=mesh)
        assert restore_trainer(resumed, tmp_path / "solver") == 1
        assert resumed.policy_version == 1
        embedding = resumed.params["embed"]["embedding"][...]
        assert embedding.sharding.mesh == resumed.mesh  # read straight onto the new mesh
        run_iteration(resumed, second, MICRO)
        resumed.apply()
        assert resumed.policy_version == uninterrupted.policy_version == 2
        assert rel_err(resumed.params, uninterrupted.params) < 1e-6, dict(resumed.mesh.shape)
        assert rel_err(resumed._opt_state, uninterrupted._opt_state) < 1e-6


def test_every_agent_round_trips_and_mismatches_are_refused(tiny_model_config, initial, tmp_path):
    trainers = {name: make_trainer(tiny_model_config, initial, MICRO, agent=name) for name in ("a", "b")}
    run_iteration(trainers["a"], random_rows(8, seed=3), MICRO)
    with pytest.raises(RuntimeError, match="accumulated but not applied"):
        save_trainer(trainers["a"], tmp_path / "a")
    trainers["a"].apply()
    assert save_all(trainers, tmp_path) == {"a": 1, "b": 0}

    fresh = {name: make_trainer(tiny_model_config, initial, MICRO, agent=name) for name in ("a", "b")}
    assert restore_all(fresh, tmp_path) == {"a": 1, "b": 0}
    for name in ("a", "b"):
        saved, _ = flatten_to_names(trainers[name].checkpoint_state())
        loaded, _ = flatten_to_names(fresh[name].checkpoint_state())
        assert saved.keys() == loaded.keys() and any(k.startswith("opt_state.") for k in saved)
        for key in saved:
            np.testing.assert_array_equal(np.asarray(saved[key]), np.asarray(loaded[key]), err_msg=key)

    with pytest.raises(ValueError, match="checkpoint .* has agent='a', but this trainer has agent='b'"):
        restore_trainer(fresh["b"], tmp_path / "a")
    other_model = dataclasses.replace(tiny_model_config, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="has model_config="):
        restore_trainer(make_trainer(other_model, None, MICRO, agent="a"), tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no checkpoint for policy_version=7"):
        restore_trainer(fresh["a"], tmp_path / "a", policy_version=7)


def test_bfloat16_master_weights_round_trip_through_checkpoints_and_swaps(tiny_model_config, initial, tmp_path):
    config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=LOSS, optimizer=ADAM, dtype="bfloat16",
                            fp32_master_weights=True)
    trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
    run_iteration(trainer, random_rows(8, seed=5), MICRO)
    trainer.apply()
    save_trainer(trainer, tmp_path / "solver")
    saved, _ = flatten_to_names(trainer.checkpoint_state())
    assert any(key.startswith("master.") for key in saved)

    fresh = AgentTrainer("solver", tiny_model_config, config, initial=initial)
    assert restore_trainer(fresh, tmp_path / "solver") == 1
    loaded, _ = flatten_to_names(fresh.checkpoint_state())
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert loaded[key].dtype == saved[key].dtype, key
        np.testing.assert_array_equal(np.asarray(saved[key]), np.asarray(loaded[key]), err_msg=key)

    # a swap to another device (shared training slices) carries the master copy along; one device keeps the
    # bfloat16 sums in the same order, so both continue identically
    mesh = make_mesh(jax.devices()[1:2], fsdp=1)
    state = fresh.swap_state()
    fresh.load_swap_state(jax.device_put(state, fresh.swap_shardings(mesh)), mesh=mesh)
    rows = random_rows(8, seed=6)
    for t in (trainer, fresh):
        run_iteration(t, rows, MICRO)
        t.apply()
    assert fresh.params["embed"]["embedding"][...].sharding.mesh == mesh
    assert rel_err(fresh.checkpoint_state()["master"], trainer.checkpoint_state()["master"]) < 1e-6
