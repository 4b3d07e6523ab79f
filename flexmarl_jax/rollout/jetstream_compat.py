"""The one place that imports JetStream (google-jetstream 0.2.2).

Import this module only where JetStream is actually needed: importing it pulls
in seqio and with it TensorFlow (several seconds), which is why
`flexmarl_jax.rollout/__init__.py` and the CLI never import it eagerly.

Two fixes are applied, both before/around JetStream's own imports:

* JetStream 0.2.2's orchestrator calls `jax.tree_map`, which current JAX
  removed; we supply it as an alias of `jax.tree_util.tree_map` (only when it
  is missing, so a JAX that still has it is left alone).
* JetStream's orchestrator sets the *root* logger to DEBUG and attaches a
  stdout handler at import time. Libraries must not reconfigure the root
  logger, so we put back the level and the handler list that were there
  before the import.

Where JetStream cannot be imported (a machine without it or without TensorFlow), `engine_api`,
`tokenizer_api` and `tokenizer_pb2` are `engine_api_fallback` (plain base classes with JetStream's field
names), `orchestrator`, `jetstream_pb2` and `token_utils` are None, and `JETSTREAM_AVAILABLE` is False.

TensorFlow (pulled in by seqio) also writes C++ INFO lines to stderr at import
("Could not find cuda drivers", absl's pre-initialisation notice) whatever
TF_CPP_MIN_LOG_LEVEL says. The import runs with the process's stderr file
descriptor diverted, so a run prints our output only; the lines come back with
absl's `--verbosity=0` or higher, and are printed if the import fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

import jax
from absl import logging as absl_logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@contextlib.contextmanager
def _native_stderr_diverted() -> Iterator[None]:
    """Sends what native code writes to file descriptor 2 to a temporary file while the block runs; replays
    it if the block raises. A no-op when absl's verbosity asks for INFO lines."""
    if absl_logging.get_verbosity() >= absl_logging.INFO:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as diverted:
        os.dup2(diverted.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            diverted.seek(0)
            os.write(2, diverted.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)

if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree_util.tree_map

_root_logger = logging.getLogger()
_root_level_before = _root_logger.level
_root_handlers_before = list(_root_logger.handlers)
try:
    with _native_stderr_diverted():
        from jetstream.core import orchestrator  # noqa: E402  (must follow the tree_map fix)
        from jetstream.core.proto import jetstream_pb2  # noqa: E402
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402
    JETSTREAM_AVAILABLE = True
    JETSTREAM_IMPORT_ERROR: Exception | None = None
except ImportError as error:
    # No JetStream (or no TensorFlow under it): the engine and the in-process loop still work on plain base
    # classes; only the Driver path (orchestrator, jetstream_pb2, token_utils) is unavailable.
    from flexmarl_jax.rollout import engine_api_fallback as engine_api  # noqa: E402

    tokenizer_api = tokenizer_pb2 = engine_api  # the fallback module holds the names of all three
    orchestrator = jetstream_pb2 = token_utils = None
    JETSTREAM_AVAILABLE = False
    JETSTREAM_IMPORT_ERROR = error
    logging.getLogger(__name__).info("JetStream not importable (%s); FlexEngine uses plain base classes", error)
finally:
    _root_logger.setLevel(_root_level_before)
    for _handler in list(_root_logger.handlers):
        if _handler not in _root_handlers_before:
            _root_logger.removeHandler(_handler)

__all__ = [
    "JETSTREAM_AVAILABLE",
    "JETSTREAM_IMPORT_ERROR",
    "engine_api",
    "jetstream_pb2",
    "orchestrator",
    "token_utils",
    "tokenizer_api",
    "tokenizer_pb2",
]
