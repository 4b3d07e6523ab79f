"""launch/gpu_multinode.sh with stand-in `flexmarl` and `ssh` commands: one process per node with the
coordinator, the process count and its rank; missing settings fail in one line before anything runs."""

import shlex

import pytest

pytestmark = pytest.mark.timeout(60)

NODE = {"COORDINATOR": "10.0.0.1:12355", "NUM_NODES": "4", "NODE_RANK": "2"}


def distributed_flags(coordinator: str, processes: int, rank: int) -> list[str]:
    return ["train", "--config.distributed.enabled=True", f"--config.distributed.coordinator_address={coordinator}",
            f"--config.distributed.num_processes={processes}", f"--config.distributed.process_id={rank}"]


def test_node_runs_flexmarl_with_the_distributed_settings_then_the_callers_args(stand_ins):
    result = stand_ins.run("gpu_multinode.sh", "node", "--config=configs/gsm8k_chain.py", "--workdir=/shared/run",
                           env=NODE)
    assert result.returncode == 0, result.stderr
    assert stand_ins.calls("flexmarl") == [
        [*distributed_flags("10.0.0.1:12355", 4, 2), "--config=configs/gsm8k_chain.py", "--workdir=/shared/run"]]
    assert stand_ins.calls("ssh") == []


def test_node_under_slurm_takes_rank_and_count_from_srun(stand_ins):
    result = stand_ins.run("gpu_multinode.sh", "node",
                           env={"COORDINATOR": "gpu-a:1234", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"})
    assert result.returncode == 0, result.stderr
    assert stand_ins.calls("flexmarl") == [distributed_flags("gpu-a:1234", 2, 1)]


@pytest.mark.parametrize("env, message", [
    ({**NODE, "COORDINATOR": ""}, "set COORDINATOR (HOST:PORT of node 0's coordinator, e.g. 10.0.0.1:12355)"),
    ({**NODE, "COORDINATOR": "10.0.0.1"}, "COORDINATOR=10.0.0.1 must be HOST:PORT"),
    ({"COORDINATOR": "h:1", "NODE_RANK": "0"}, "set NUM_NODES (the number of nodes, one process each)"),
    ({"COORDINATOR": "h:1", "NUM_NODES": "2"}, "set NODE_RANK (this node's rank, 0 .. NUM_NODES-1)"),
    ({**NODE, "NODE_RANK": "4"}, "NODE_RANK=4 must be in 0 .. 3"),
    ({**NODE, "NUM_NODES": "0"}, "NUM_NODES=0 must be a positive integer"),
])
def test_node_bad_settings_fail_in_one_line_before_running_anything(stand_ins, env, message):
    result = stand_ins.run("gpu_multinode.sh", "node", env=env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"gpu_multinode.sh: {message}"]
    assert stand_ins.calls("flexmarl") == []


def test_ssh_starts_one_process_per_host_with_host_zero_as_coordinator(stand_ins, tmp_path):
    logs = tmp_path / "node-logs"
    result = stand_ins.run("gpu_multinode.sh", "ssh", "--config.seed=1", "--workdir=/shared/run a",
                           env={"HOSTS": "gpu-a gpu-b gpu-c", "PORT": "2222", "REMOTE_DIR": "/home/me/flexmarl jax",
                                "LOGS_DIR": str(logs)})
    assert result.returncode == 0, result.stderr
    calls = sorted(stand_ins.calls("ssh"))  # started in parallel: any order
    assert [call[0] for call in calls] == ["gpu-a", "gpu-b", "gpu-c"]
    for rank, (_host, *command) in enumerate(calls):
        words = shlex.split(" ".join(command))
        assert words == ["cd", "/home/me/flexmarl jax", "&&", "COORDINATOR=gpu-a:2222", "NUM_NODES=3",
                         f"NODE_RANK={rank}", "bash", "launch/gpu_multinode.sh", "node", "--config.seed=1",
                         "--workdir=/shared/run a"]
    assert sorted(path.name for path in logs.iterdir()) == ["node-0.log", "node-1.log", "node-2.log"]
    assert stand_ins.calls("flexmarl") == []  # nothing ran here


def test_ssh_fails_when_a_node_fails_and_names_it(stand_ins, tmp_path):
    result = stand_ins.run("gpu_multinode.sh", "ssh", env={"HOSTS": "gpu-a gpu-b", "LOGS_DIR": str(tmp_path / "l"),
                                                           "FAKE_SSH_EXIT": "1"})
    assert result.returncode == 1
    assert f"node 1 (gpu-b) failed; see {tmp_path / 'l'}/node-1.log" in result.stderr


def test_ssh_needs_hosts(stand_ins):
    result = stand_ins.run("gpu_multinode.sh", "ssh", env={})
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["gpu_multinode.sh: set HOSTS (the nodes, space-separated; the first runs "
                                          "the coordinator)"]
    assert stand_ins.calls("ssh") == []
