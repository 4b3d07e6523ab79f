"""launch/tpu_vm.sh against a recording gcloud stand-in: each subcommand's gcloud calls and flags, missing
settings, and that nothing but gcloud is ever called."""

import shlex
import tarfile

import pytest

from tests.launch.conftest import without

pytestmark = pytest.mark.timeout(120)

BASE = {"TPU_NAME": "team-tpu", "ZONE": "us-west4-a"}
WORKER = "~/flexmarl/tpu_worker.sh"


def only_gcloud(stand_ins) -> None:
    """The script reached other machines only through gcloud, and ran no flexmarl here."""
    assert stand_ins.calls("ssh") == stand_ins.calls("scp") == stand_ins.calls("curl") == []
    assert stand_ins.calls("flexmarl") == []


def remote_command(call: list[str]) -> list[str]:
    """The words of an `ssh --command=...` call's command, as the worker's shell splits them."""
    [command] = [arg.removeprefix("--command=") for arg in call if arg.startswith("--command=")]
    return shlex.split(command)


@pytest.mark.parametrize("accelerator, accelerator_type, runtime", [
    ("v5litepod-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),
    ("v5e-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),  # the TPU API's name for v5e
    ("v5e-32", "v5litepod-32", "v2-alpha-tpuv5-lite"),  # a pod slice: 8 workers
    ("v6e-8", "v6e-8", "v2-alpha-tpuv6e"),
    ("v5p-8", "v5p-8", "v2-alpha-tpuv5"),
    ("v4-32", "v4-32", "tpu-ubuntu2204-base"),
])
def test_create_names_the_accelerator_and_its_runtime_version(stand_ins, accelerator, accelerator_type, runtime):
    result = stand_ins.run("tpu_vm.sh", "create", env={**BASE, "ACCELERATOR": accelerator, "PROJECT": "p1"})
    assert result.returncode == 0, result.stderr
    assert stand_ins.calls("gcloud") == [[
        "compute", "tpus", "tpu-vm", "create", "team-tpu", "--zone=us-west4-a", "--project=p1",
        f"--accelerator-type={accelerator_type}", f"--version={runtime}"]]
    only_gcloud(stand_ins)


def test_runtime_overrides_the_default_and_an_unknown_accelerator_needs_it(stand_ins):
    env = {**BASE, "ACCELERATOR": "v7x-8"}
    result = stand_ins.run("tpu_vm.sh", "create", env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tpu_vm.sh: set RUNTIME: no default TPU software version for ACCELERATOR=v7x-8 "
        "(gcloud compute tpus versions list --zone=us-west4-a lists them)"]
    assert stand_ins.calls("gcloud") == []
    result = stand_ins.run("tpu_vm.sh", "create", env={**env, "RUNTIME": "v2-alpha-tpu7x"})
    assert result.returncode == 0, result.stderr
    assert stand_ins.calls("gcloud")[0][-2:] == ["--accelerator-type=v7x-8", "--version=v2-alpha-tpu7x"]


def test_queued_creates_a_queued_resource_with_runtime_version(stand_ins):
    result = stand_ins.run("tpu_vm.sh", "queued", env={**BASE, "ACCELERATOR": "v6e-8"})
    assert result.returncode == 0, result.stderr
    assert stand_ins.calls("gcloud") == [[
        "compute", "tpus", "queued-resources", "create", "team-tpu", "--node-id=team-tpu", "--zone=us-west4-a",
        "--accelerator-type=v6e-8", "--runtime-version=v2-alpha-tpuv6e"]]
    assert not any(arg.startswith("--version") for arg in stand_ins.calls("gcloud")[0])
    result = stand_ins.run("tpu_vm.sh", "queued", env={**BASE, "ACCELERATOR": "v5e-32", "QUEUED_ID": "qr-1"})
    assert stand_ins.calls("gcloud")[1][4:6] == ["qr-1", "--node-id=team-tpu"]
    assert "--accelerator-type=v5litepod-32" in stand_ins.calls("gcloud")[1]
    only_gcloud(stand_ins)


def test_install_from_a_git_url_runs_the_worker_script_on_every_worker(stand_ins):
    url = "https://example.com/team/flexmarl-jax.git@v1"
    result = stand_ins.run("tpu_vm.sh", "install", env={**BASE, "REPO_URL": url})
    assert result.returncode == 0, result.stderr
    copy, install = stand_ins.calls("gcloud")
    assert copy[:3] == ["compute", "tpus", "tpu-vm"] and copy[3] == "scp"
    assert copy[4].endswith("launch/tpu_worker.sh") and copy[5] == "team-tpu:"
    assert "--worker=all" in copy and "--zone=us-west4-a" in copy
    assert install[:5] == ["compute", "tpus", "tpu-vm", "ssh", "team-tpu"] and "--worker=all" in install
    assert remote_command(install)[-6:] == ["bash", WORKER, "install", "git", url, "tpu"]
    only_gcloud(stand_ins)


def test_install_of_the_local_tree_copies_a_tarball_of_it_to_every_worker(stand_ins, tmp_path):
    # The stand-in keeps a copy of what scp is given, before the script removes its staging folder.
    keep = tmp_path / "kept.tar.gz"
    stand_ins.folder.joinpath("gcloud").write_text(stand_ins.folder.joinpath("gcloud").read_text().replace(
        "sys.exit(", f"[__import__('shutil').copy(a, {str(keep)!r}) for a in sys.argv if a.endswith('.tar.gz')]\n"
        "sys.exit(", 1))
    result = stand_ins.run("tpu_vm.sh", "install", env={**BASE, "EXTRAS": "tpu,test"})
    assert result.returncode == 0, result.stderr
    copy, install = stand_ins.calls("gcloud")
    assert copy[3] == "scp" and copy[4].endswith("launch/tpu_worker.sh") and copy[5].endswith("/flexmarl-src.tar.gz")
    assert copy[6] == "team-tpu:" and "--worker=all" in copy
    assert "--worker=all" in install
    assert remote_command(install)[-6:] == ["bash", WORKER, "install", "tree", "~/flexmarl/flexmarl-src.tar.gz",
                                            "tpu,test"]
    with tarfile.open(keep) as tarball:
        names = set(tarball.getnames())
    assert {"pyproject.toml", "flexmarl_jax/__init__.py", "configs/gsm8k_chain.py", "launch/tpu_worker.sh"} <= names
    assert not any(name.startswith((".venv/", ".git/")) or "/__pycache__/" in name for name in names)
    only_gcloud(stand_ins)


def test_train_runs_one_process_per_worker_and_collects_each_workers_log(stand_ins, tmp_path):
    stream = tmp_path / "stream.txt"
    stream.write_text("[worker 0] iteration 1\n[worker 1] joined\ngcloud's own line\n[worker 0] iteration 2\n"
                      "ssh client's prefix: [worker 12] a [worker 1] tag inside the text\n")
    args = ["--config=configs/gsm8k_chain.py:tpu_v5e_32", "--workdir=gs://bucket/run 1", "--config.seed=3"]
    logs = tmp_path / "collected"
    result = stand_ins.run("tpu_vm.sh", "train", *args,
                           env={**BASE, "LOGS_DIR": str(logs), "FAKE_GCLOUD_OUTPUT": str(stream)})
    assert result.returncode == 0, result.stderr
    [call] = stand_ins.calls("gcloud")
    assert call[:5] == ["compute", "tpus", "tpu-vm", "ssh", "team-tpu"]
    assert "--worker=all" in call and "--zone=us-west4-a" in call
    # The arguments reach the worker script word for word (the space in the workdir included).
    assert remote_command(call) == ["bash", WORKER, "train", *args]
    assert result.stdout == stream.read_text()  # streamed as it came
    assert (logs / "worker-0.log").read_text() == "iteration 1\niteration 2\n"
    assert (logs / "worker-1.log").read_text() == "joined\n"
    assert (logs / "worker-12.log").read_text() == "a [worker 1] tag inside the text\n"
    assert sorted(path.name for path in logs.iterdir()) == ["worker-0.log", "worker-1.log", "worker-12.log"]
    only_gcloud(stand_ins)


def test_a_failed_remote_run_fails_the_subcommand(stand_ins):
    result = stand_ins.run("tpu_vm.sh", "train", env={**BASE, "FAKE_GCLOUD_EXIT": "3"})
    assert result.returncode == 3


def test_logs_collects_each_workers_log_and_can_follow(stand_ins, tmp_path):
    stream = tmp_path / "stream.txt"
    stream.write_text("[worker 1] b\n[worker 0] a\n")
    logs = tmp_path / "collected"
    logs.mkdir()
    (logs / "worker-7.log").write_text("from an earlier, larger slice\n")
    env = {**BASE, "LOGS_DIR": str(logs), "FAKE_GCLOUD_OUTPUT": str(stream)}
    assert stand_ins.run("tpu_vm.sh", "logs", env=env).returncode == 0
    assert stand_ins.run("tpu_vm.sh", "logs", "follow", env=env).returncode == 0
    once, follow = stand_ins.calls("gcloud")
    assert "--worker=all" in once and remote_command(once) == ["bash", WORKER, "logs"]
    assert remote_command(follow) == ["bash", WORKER, "logs", "follow"]
    assert sorted(path.name for path in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    assert (logs / "worker-1.log").read_text() == "b\n"
    only_gcloud(stand_ins)


def test_delete_a_vm_or_a_queued_resource(stand_ins):
    assert stand_ins.run("tpu_vm.sh", "delete", env=BASE).returncode == 0
    assert stand_ins.run("tpu_vm.sh", "delete", env={**BASE, "QUEUED_ID": "qr-1"}).returncode == 0
    assert stand_ins.calls("gcloud") == [
        ["compute", "tpus", "tpu-vm", "delete", "team-tpu", "--zone=us-west4-a", "--quiet"],
        ["compute", "tpus", "queued-resources", "delete", "qr-1", "--zone=us-west4-a", "--force", "--quiet"]]
    only_gcloud(stand_ins)


@pytest.mark.parametrize("subcommand, env, missing", [
    (subcommand, without(BASE, name), name)
    for subcommand in ("create", "queued", "install", "train", "logs", "delete") for name in BASE
] + [("create", BASE, "ACCELERATOR"), ("queued", BASE, "ACCELERATOR")])
def test_a_missing_setting_is_one_line_before_any_gcloud_call(stand_ins, subcommand, env, missing):
    result = stand_ins.run("tpu_vm.sh", subcommand, env=env)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"tpu_vm.sh: set {missing} (")
    assert stand_ins.calls("gcloud") == []
    only_gcloud(stand_ins)


def test_an_unknown_subcommand_prints_the_usage(stand_ins):
    result = stand_ins.run("tpu_vm.sh", "start", env=BASE)
    assert result.returncode == 2 and result.stderr.startswith("usage: launch/tpu_vm.sh create|queued|install|")
    assert stand_ins.calls("gcloud") == []
