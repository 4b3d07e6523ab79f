"""Benchmarks behind `flexmarl bench NAME`; each module exposes `main(argv) -> int` and writes `--json PATH`.

They live in the repository's `benchmarks/` folder, outside the installed library: `flexmarl bench` runs them
from a checkout (it puts this folder on the import path). The package is not called `benchmarks` because the
google-jetstream wheel installs a top-level package of that name.

Importing it also puts its folder on PYTHONPATH, so the child processes that benchmarks start
(`python -m flexmarl_benchmarks._worker ...`) find it too.
"""

import os

_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _FOLDER not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_FOLDER, os.environ.get("PYTHONPATH")) if p)
