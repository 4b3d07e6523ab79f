"""The one place that imports JetStream (google-jetstream 0.2.2).

Import this module only where JetStream is actually needed (the Driver that `flexmarl serve` runs, and its
tests): importing it pulls in seqio and with it TensorFlow (several seconds). Our engines build on
`engine_api.py`'s plain types instead; `driver_engine` hands one to JetStream's Driver.

JetStream 0.2.2 has two incompatibilities with current JAX and Python logging practice, both confined to its
`orchestrator` module (the Driver and the gRPC servicer), which only the server needs. That module is therefore
not imported here; `load_orchestrator()` imports it on demand and fixes both without touching global state:

* The orchestrator calls `jax.tree_map`, which current JAX removed. Instead of adding the alias to `jax` for
  every caller, the orchestrator module's own `jax` name is pointed at a view of `jax` that also has
  `tree_map` (only when JAX lacks it).
* The orchestrator sets the *root* logger to DEBUG and attaches a stdout handler at import time. Libraries
  must not reconfigure the root logger, so the level and handler list that were there before the import are
  put back.

Where JetStream cannot be imported (a machine without it or without TensorFlow), `engine_api`,
`tokenizer_api` and `tokenizer_pb2` are our `rollout/engine_api.py` (plain base classes with JetStream's field
names), `jetstream_pb2` and `token_utils` are None, `JETSTREAM_AVAILABLE` is False and `load_orchestrator`
raises the import error.

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
import types
from collections.abc import Iterator
from typing import Any

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


@contextlib.contextmanager
def _root_logger_kept() -> Iterator[None]:
    """Puts back the root logger's level and handlers that an import in the block changed."""
    root = logging.getLogger()
    level_before, handlers_before = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level_before)
        for handler in list(root.handlers):
            if handler not in handlers_before:
                root.removeHandler(handler)


try:
    with _root_logger_kept(), _native_stderr_diverted():
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402
    JETSTREAM_AVAILABLE = True
    JETSTREAM_IMPORT_ERROR: Exception | None = None
except ImportError as error:
    # No JetStream (or no TensorFlow under it): the engine and the in-process loop still work on plain base
    # classes; only the Driver path (orchestrator, jetstream_pb2, token_utils) is unavailable.
    from flexmarl_jax.rollout import engine_api  # noqa: E402

    tokenizer_api = tokenizer_pb2 = engine_api  # the fallback module holds the names of all three
    jetstream_pb2 = jetstream_pb2_grpc = token_utils = None
    JETSTREAM_AVAILABLE = False
    JETSTREAM_IMPORT_ERROR = error
    logging.getLogger(__name__).info("JetStream not importable (%s); FlexEngine uses plain base classes", error)


class _JaxWithTreeMap(types.ModuleType):
    """`jax` as JetStream 0.2.2's orchestrator expects it: every attribute of `jax`, plus `tree_map`."""

    tree_map = staticmethod(jax.tree_util.tree_map)

    def __getattr__(self, name: str):
        return getattr(jax, name)


def driver_engine(engine: Any) -> Any:
    """`engine` (a `FlexEngine` or `EmulatedEngine`) as JetStream's Driver drives it: a JetStream `Engine` whose
    every call is the engine's own, except that `generate` returns JetStream's `ResultTokens` (the Driver's
    detokenize thread tells results from slot updates by that type; the log-prob columns it does not read stay
    in `data`)."""
    return _DriverEngine(engine)


def _delegated_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.engine, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _delegated_property(name: str):
    return property(lambda self: getattr(self.engine, name))


class _DriverEngine(engine_api.Engine):
    def __init__(self, engine: Any):
        self.engine = engine

    def __getattr__(self, name: str):  # what the Engine API does not declare (config, tokenizer, warm_up, ...)
        return getattr(self.engine, name)

    def generate(self, params: Any, decode_state: Any):
        decode_state, result = self.engine.generate(params, decode_state)
        return decode_state, engine_api.ResultTokens(
            data=result.data, tokens_idx=result.tokens_idx, valid_idx=result.valid_idx,
            length_idx=result.length_idx, samples_per_slot=result.samples_per_slot)


# Every member the Engine API declares is the engine's own, its defaults too (JetStream's build_tokenizer would read a
# SentencePiece file), except `generate`.
for _name, _static in vars(engine_api.Engine).items():
    if _name.startswith("_") or _name == "generate" or not (callable(_static) or isinstance(_static, property)):
        continue
    setattr(_DriverEngine, _name,
            _delegated_property(_name) if isinstance(_static, property) else _delegated_method(_name))
_DriverEngine.__abstractmethods__ = frozenset()


def load_orchestrator() -> types.ModuleType:
    """JetStream's `jetstream.core.orchestrator` (Driver, LLMOrchestrator), fixed for current JAX.

    Only the orchestrator module's own `jax` name changes (to a view of `jax` with `tree_map`, where JAX lacks
    it); the root logger it reconfigures at import is put back. Idempotent. Raises the original ImportError
    where JetStream is unavailable.
    """
    if not JETSTREAM_AVAILABLE:
        raise ImportError(f"JetStream is not importable: {JETSTREAM_IMPORT_ERROR}") from JETSTREAM_IMPORT_ERROR
    with _root_logger_kept(), _native_stderr_diverted():
        # lazy: pulls TensorFlow (5.2 s); only the serving Driver needs it (tests/rollout/test_jetstream_driver.py)
        from jetstream.core import orchestrator
    if not hasattr(orchestrator.jax, "tree_map"):
        orchestrator.jax = _JaxWithTreeMap("jax")
    return orchestrator


__all__ = [
    "JETSTREAM_AVAILABLE",
    "JETSTREAM_IMPORT_ERROR",
    "driver_engine",
    "engine_api",
    "jetstream_pb2",
    "jetstream_pb2_grpc",
    "load_orchestrator",
    "token_utils",
    "tokenizer_api",
    "tokenizer_pb2",
]
