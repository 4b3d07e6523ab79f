"""On CPU hosts, unrelated computations on a mesh with several devices of each process run back to back when each
is waited for on every local device (`distributed/cpu_completion.py`)."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from flexmarl_jax.distributed.cpu_completion import needs_completion
from tests.distributed import processes


@pytest.mark.timeout(120)
def test_unrelated_computations_on_a_mesh_with_several_devices_of_each_process_run_back_to_back():
    """`cpu_completion.completed` makes each computation end on both local devices before the next starts.
    Without it this loop hung until killed (1 run of 1; a stand-alone version of it, 4 runs of 4): a
    computation's part on the second device ran beside the next one's (distributed/cpu_completion.py)."""
    port = processes.free_port()
    child = str(processes.REPO / "tests" / "distributed" / "completion_child.py")
    results = processes.wait_all(processes.start(lambda index: [child, str(port), str(index), "300"], 2,
                                                 devices_per_process=2), timeout=60)
    reports = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert [report.pop("process") for report in reports] == [0, 1]
    assert reports == [{"local_devices": 2, "needs_completion": True, "iterations": 300, "wrong": 0}] * 2


def test_a_mesh_of_one_process_needs_no_wait():
    assert not needs_completion(Mesh(np.array(jax.devices()[:4]), ("x",)))  # 4 devices of this process
