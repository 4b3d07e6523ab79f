"""The watch that the multi-process tests rely on to show no computation spans every device does see one."""

import numpy as np
from jax.experimental import multihost_utils

from tests.distributed import all_device_watch


def test_the_watch_reports_each_all_device_computation_with_its_caller(monkeypatch, capsys):
    all_device_watch.install(set_attribute=monkeypatch.setattr)
    multihost_utils.sync_global_devices("watched")
    agreed = multihost_utils.broadcast_one_to_all(np.int64(7))
    assert int(agreed) == 7  # the wrapped function still does its work
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(all_device_watch.MARK)]
    names = [line.split()[2] for line in lines]
    # sync_global_devices checks its name with assert_equal, which gathers with process_allgather
    assert names[:3] == ["sync_global_devices", "assert_equal", "process_allgather"]
    assert "broadcast_one_to_all" in names
    assert all(__file__ in line or "multihost_utils.py" in line for line in lines), lines
