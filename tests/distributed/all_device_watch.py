"""Reports on stderr every computation over every device of every process that a test's child process starts
through `jax.experimental.multihost_utils` (JAX's `device_put` of a host value onto a sharding that spans
processes checks the value with one; Orbax's default barriers are one). A multi-process run must start none:
such a computation shares gloo communicators with the training slice's and aborted runs
(flexmarl_jax/transfer/across_processes.py)."""

import sys
import traceback

MARK = "all-device computation:"
WATCHED = ("assert_equal", "process_allgather", "broadcast_one_to_all", "sync_global_devices")


def install(set_attribute=setattr) -> None:
    """Wraps `multihost_utils`' all-device functions so that each call prints `MARK`, its name and its caller.
    JAX (0.10.2: `dispatch._device_put_sharding_impl`) and Orbax look them up on the module at each call, so
    the wrappers see their calls too; a version that imported them by name would slip past the watch, and
    `test_all_device_watch.py` would still pass (it calls the module's attributes)."""
    from jax.experimental import multihost_utils

    for name in WATCHED:
        original = getattr(multihost_utils, name)

        def reported(*args, _original=original, _name=name, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            print(f"{MARK} {_name} called from {caller.filename}:{caller.lineno}", file=sys.stderr,
                  flush=True)
            return _original(*args, **kwargs)

        set_attribute(multihost_utils, name, reported)
