"""`config.distributed` (its rules, one line each) and joining: an unreachable coordinator is one clear error
within `distributed.init_timeout_s`."""

import dataclasses
import socket
import time

import pytest
from absl import flags
from orbax.checkpoint._src.multihost import multihost

from flexmarl_jax.cli.main import main
from flexmarl_jax.config import ConfigError, DistributedConfig, RunConfig, apply_overrides, load_config
from flexmarl_jax.distributed import runtime
from flexmarl_jax.distributed.coordinator_probe import CoordinatorUnreachable, wait_for_coordinator


def _config(**fields) -> RunConfig:
    return RunConfig.from_config(apply_overrides(load_config("configs/tiny.py:smoke"),
                                                 {f"distributed.{key}": str(value) for key, value in fields.items()}))


def test_the_defaults_mean_one_process_with_a_heartbeat_of_at_most_30_s():
    settings = _config().distributed
    assert (settings.enabled, settings.coordinator_address, settings.num_processes, settings.process_id) == (
        False, "", 0, -1)
    assert 0 < settings.heartbeat_timeout_s <= 30 and settings.init_timeout_s > 0
    assert DistributedConfig() == settings  # the typed defaults are configs/tiny.py's


@pytest.mark.parametrize(("fields", "message"), [
    ({"enabled": True, "coordinator_address": "10.0.0.2:8476"},
     r"^config.distributed: coordinator_address='10.0.0.2:8476', num_processes=0 and process_id=-1 are set together"),
    ({"enabled": True, "coordinator_address": "10.0.0.2:8476", "num_processes": 2, "process_id": 2},
     r"^config.distributed.process_id=2 must be below distributed.num_processes=2$"),
    ({"coordinator_address": "10.0.0.2:8476", "num_processes": 2, "process_id": 1},
     r"^config.distributed.coordinator_address='10.0.0.2:8476' is set but distributed.enabled=False"),
    ({"enabled": True, "coordinator_address": "no-port"},
     r"^config.distributed.coordinator_address='no-port' must be HOST:PORT"),
    ({"heartbeat_timeout_s": 0}, r"^config.distributed.heartbeat_timeout_s=0.0 must be > 0$"),
    ({"process_id": -2}, r"^config.distributed.process_id=-2 must be >= 0, or -1 to auto-detect it$"),
])
def test_bad_distributed_settings_are_one_line_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        _config(**fields)


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_probe_waits_for_a_coordinator_that_starts_late_and_gives_up_on_one_that_never_does():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert wait_for_coordinator(f"127.0.0.1:{listener.getsockname()[1]}", 5.0, process_id=1) < 5.0
    port = _closed_port()
    started = time.monotonic()
    expected = (rf"^process 1: the coordinator at 127.0.0.1:{port} \(process 0\) did not accept a connection "
                r"within distributed.init_timeout_s=1 s")
    with pytest.raises(CoordinatorUnreachable, match=expected):
        wait_for_coordinator(f"127.0.0.1:{port}", 1.0, process_id=1, poll_s=0.1)
    assert 1.0 <= time.monotonic() - started < 3.0


@pytest.mark.timeout(60)
def test_flexmarl_train_with_an_unreachable_coordinator_fails_in_one_line_within_the_init_timeout(tmp_path, capsys):
    port = _closed_port()
    workdir = tmp_path / "run"
    started = time.monotonic()
    code = main(["train", "--config=configs/tiny.py:smoke", f"--workdir={workdir}",
                 "--config.distributed.enabled=True", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                 "--config.distributed.num_processes=2", "--config.distributed.process_id=1",
                 "--config.distributed.init_timeout_s=2", "--config.pipeline.deterministic=True",
                 "--config.rollout.instances_per_agent=2", "--config.mesh.train_devices_per_agent=2"])
    elapsed = time.monotonic() - started
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and 2.0 <= elapsed < 10.0
    assert len(error) == 1 and error[0].startswith(
        f"flexmarl train: config error: process 1: the coordinator at 127.0.0.1:{port} (process 0) did not accept")
    assert not workdir.exists()  # nothing written: the probe runs before the workdir is locked


def test_a_config_error_keeps_dataclass_replace_checked():
    config = _config()
    with pytest.raises(ConfigError, match=r"process_id=3 must be below distributed.num_processes=2"):
        dataclasses.replace(config, distributed=DistributedConfig(
            enabled=True, coordinator_address="h:1", num_processes=2, process_id=3))


@pytest.mark.parametrize(("overrides", "message"), [
    ({}, r"^config.distributed.enabled=True needs pipeline.deterministic=True"),
    ({"pipeline.deterministic": "True", "pipeline.mode": "serial"},
     r"^config.distributed.enabled=True needs disaggregated devices .* pipeline.mode='serial'"),
    ({"pipeline.deterministic": "True", "rollout.instances_per_agent": "3"},
     r"^config.rollout.instances_per_agent=3 must be a multiple of the 2 processes"),
    # A training mesh on one process: every process issues every training computation (before the rule: a
    # warm-up that died in "Fetching value for `jax.Array` that spans non-addressable devices").
    ({"pipeline.deterministic": "True", "rollout.instances_per_agent": "2"},
     r"^config.mesh.train_devices_per_agent=1 must be a multiple of the 2 processes"),
])
def test_a_run_of_several_processes_needs_the_deterministic_replayed_rollout(overrides, message):
    fields = {"distributed.enabled": "True", "distributed.coordinator_address": "h:1",
              "distributed.num_processes": "2", "distributed.process_id": "0", **overrides}
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_config(apply_overrides(load_config("configs/tiny.py:smoke"), fields))


def test_orbax_reads_its_barrier_switch_as_on_though_absl_never_parsed_its_flags(monkeypatch):
    """A run of several processes turns Orbax's barriers onto the runtime's key-value service; if Orbax could not
    read the switch (absl raises for an unparsed flag), it would fall back to a computation over every device."""
    flag = flags.FLAGS[runtime.ORBAX_BARRIER_FLAG]
    monkeypatch.setattr(flag, "value", flag.value)  # restored after the test
    monkeypatch.setattr(flag, "present", flag.present)
    assert not flags.FLAGS.is_parsed()
    runtime.use_orbax_key_value_barriers()
    assert multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value is True
