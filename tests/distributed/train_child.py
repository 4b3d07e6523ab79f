"""One process of a multi-process `flexmarl train` in tests, with what attributes its writes.

argv: LEDGER UMASK FLEXMARL_ARGS... Every file this process creates gets the mode bits its own umask leaves
(so a file's creator shows in its mode, whatever library wrote it: TensorStore and Orbax write from C++), and
every write Python makes (open for writing, rename, replace, remove) is appended to LEDGER through an audit
hook (so a file that two processes rewrote or appended to would show both). All-device computations are
reported on stderr (all_device_watch)."""

import os
import sys

ledger_path, umask, argv = sys.argv[1], int(sys.argv[2], 8), sys.argv[3:]
os.umask(umask)
ledger = open(ledger_path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def record(event, args):
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
        if writing and isinstance(path, (str, bytes, os.PathLike)):
            ledger.write(os.path.abspath(os.fsdecode(path)) + "\n")
    elif event in ("os.rename", "os.replace"):
        ledger.write(os.path.abspath(os.fsdecode(args[1])) + "\n")
    elif event == "os.remove":
        ledger.write(os.path.abspath(os.fsdecode(args[0])) + "\n")


sys.addaudithook(record)
from tests.distributed import all_device_watch  # noqa: E402

all_device_watch.install()
from flexmarl_jax.cli.main import main  # noqa: E402 - after the hook, so imports' writes count too

sys.exit(main(argv))
