"""Stand-ins for the commands the launch scripts call (gcloud, ssh, flexmarl), put first on PATH.

Each stand-in appends its argv as one JSON line to `<name>.calls` in the stand-in folder and exits with
`$FAKE_<NAME>_EXIT` (default 0); `$FAKE_<NAME>_OUTPUT`, a file, is printed to stdout. Commands that a script
must never run (curl, and ssh/scp where only gcloud may reach a machine) are stand-ins too, so a call to one
is recorded rather than run.
"""

import json
import pathlib
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
# bash, awk, sed, tar, git, mktemp: the tools the scripts themselves use; nothing else of this machine's PATH.
SYSTEM_PATH = "/usr/bin:/bin"

STAND_IN = """#!{python}
import json, os, pathlib, sys
name = pathlib.Path(sys.argv[0]).name
here = pathlib.Path(__file__).parent
with open(here / (name + ".calls"), "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
key = "FAKE_" + name.upper()
if os.environ.get(key + "_OUTPUT"):
    sys.stdout.write(pathlib.Path(os.environ[key + "_OUTPUT"]).read_text())
sys.exit(int(os.environ.get(key + "_EXIT", "0")))
"""


class StandIns:
    """A folder of recording stand-ins and the environment that puts it first on PATH."""

    def __init__(self, folder: pathlib.Path, names):
        self.folder = folder
        folder.mkdir()
        for name in names:
            path = folder / name
            path.write_text(STAND_IN.format(python=sys.executable))
            path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def calls(self, name: str) -> list[list[str]]:
        """Each call's argv (without the command name), in order."""
        path = self.folder / f"{name}.calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def run(self, script: str, *args: str, env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
        """Runs launch/SCRIPT with only `env` (plus PATH and HOME) in its environment."""
        full_env = {"PATH": f"{self.folder}:{SYSTEM_PATH}", "HOME": str(self.folder.parent), **env}
        return subprocess.run(["bash", str(LAUNCH / script), *args], env=full_env, cwd=cwd or self.folder.parent,
                              capture_output=True, text=True, timeout=60)


@pytest.fixture
def stand_ins(tmp_path):
    return StandIns(tmp_path / "bin", ("gcloud", "ssh", "scp", "curl", "flexmarl"))


def without(env: dict[str, str], name: str) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != name}

