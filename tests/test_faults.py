"""The fault injection registry: off unless armed, exact trigger counts, and an unknown name lists the known ones."""

import dataclasses

import pytest

from flexmarl_jax import faults


@pytest.fixture(autouse=True)
def _disarmed():
    faults.disarm()
    yield
    faults.disarm()


def test_an_armed_fault_triggers_after_and_times_as_asked():
    assert not faults.fire("trainer_error", "solver")  # nothing armed: never
    faults.arm("trainer_error", after=2, times=2, where="solver")
    hits = [faults.fire("trainer_error", agent) for agent in ["solver", "verifier", "solver", "solver", "solver",
                                                               "solver"]]
    assert hits == [False, False, False, True, True, False]  # the verifier is not a target; 2 pass, 2 fire
    assert faults.fired("trainer_error") == 2
    faults.arm("weight_sync", times=0)
    with pytest.raises(faults.InjectedFault, match="injected fault weight_sync at critic: a weight sync"):
        faults.raise_if_fired("weight_sync", "critic")
    assert all(faults.fire("weight_sync") for _ in range(5))  # times=0: every hit


def test_hits_first_trigger_time_and_detections_are_kept_while_armed(monkeypatch):
    import time

    faults.detected("an instance failed")  # nothing armed: not kept
    assert faults.detections() == []
    faults.arm("store_commit", after=1)
    assert faults.fired_at("store_commit") is None
    before = time.time()
    assert [faults.fire("store_commit") for _ in range(3)] == [False, True, False]
    assert faults.hits("store_commit") == 3 and before <= faults.fired_at("store_commit") <= time.time()
    faults.detected("the run stops (error)")
    (at, what), = faults.detections()
    assert what == "the run stops (error)" and at >= faults.fired_at("store_commit")
    faults.arm("instance_crash", after=100)  # counted per target: the bench draws an instance's moment from its own
    for target in ["instance0", "instance1", "instance0"]:
        assert not faults.fire("instance_crash", target)
    assert faults.hit_targets("instance_crash") == {"instance0": 2, "instance1": 1}
    assert faults.hits("instance_crash", "instance0") == 2 and faults.hits("instance_crash") == 3
    faults.disarm()
    assert faults.detections() == [] and faults.hits("store_commit") == 0


def test_unknown_names_and_options_list_what_is_known():
    known = ", ".join(faults.FAULTS)
    with pytest.raises(ValueError, match=rf"^unknown fault 'disk_full'; known faults: {known}$"):
        faults.arm("disk_full")
    with pytest.raises(ValueError, match=r"^unknown fault 'nope'"):
        faults.arm_from_env({faults.ENV_VAR: "trainer_error,nope"})
    with pytest.raises(ValueError, match=r"unknown option 'when'; options: after, times, where"):
        faults.parse("instance_hang:when=3")
    assert faults.arm_from_env({faults.ENV_VAR: "instance_hang:after=3:where=instance1,store_commit"}) == [
        "instance_hang", "store_commit"]
    assert faults.arm_from_env({}) == []


def test_an_unknown_fault_in_the_environment_is_a_one_line_error_of_flexmarl_train(monkeypatch, tmp_path):
    from flexmarl_jax.config import RunConfig, load_config
    from flexmarl_jax.config.errors import ConfigError
    from flexmarl_jax.orchestrator.run import run_training

    monkeypatch.setenv(faults.ENV_VAR, "disk_full")
    config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
    with pytest.raises(ConfigError, match=r"^\$FLEXMARL_FAULTS: unknown fault 'disk_full'; known faults: "):
        run_training(dataclasses.replace(config, workdir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()  # nothing written
