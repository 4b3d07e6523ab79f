"""JetStream's gRPC servicer (`LLMOrchestrator`: Decode, HealthCheck) with request checks in front of its Driver.

Importing this module imports JetStream's orchestrator (`jetstream_compat.load_orchestrator`), so only the
server imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from flexmarl_jax.rollout.jetstream_compat import jetstream_pb2, load_orchestrator
from flexmarl_jax.serve.request_checks import RequestLimits, decode_request_problem

orchestrator = load_orchestrator()

# The Driver puts a BOS in front of token content unless the request continues a session (its `is_bos` is
# `not request.session_cache`), and a BOS-less tokenizer (Qwen's) has no BOS id to put there. For such
# tokenizers the servicer marks every checked request as continuing this made-up session, which the Driver
# reads only to decide that; clients may not set session_cache themselves (request_checks refuses it).
NO_BOS_SESSION = "flexmarl:no-bos"


class CheckedOrchestrator(orchestrator.LLMOrchestrator):
    """`LLMOrchestrator` that refuses, with INVALID_ARGUMENT and a one-line reason, every request its engine
    cannot serve (request_checks), before the request reaches a Driver thread, where an error would kill the
    process.

    Args:
      driver: JetStream's `orchestrator.Driver` over the engine.
      tokenizer: the engine's tokenizer (models/tokenizer.py), to count a text prompt's tokens.
      limits: the engine's `RequestLimits`.
    """

    def __init__(self, driver: Any, tokenizer: Any, limits: RequestLimits):
        super().__init__(driver=driver)
        self._tokenizer = tokenizer
        self._limits = limits

    def _get_prefill_content(self, request: jetstream_pb2.DecodeRequest) -> tuple[str | np.ndarray, bool]:
        """Token content as an int32 array instead of JetStream's list: its `pad_tokens` reads `tokens.shape`
        when it adds no BOS (a list has none, and the prefill thread would die), and arrays work either way."""
        content, client_side = super()._get_prefill_content(request)
        return (np.asarray(content, dtype=np.int32) if client_side else content), client_side

    async def Decode(  # noqa: N802  (the gRPC method's name)
        self, request: jetstream_pb2.DecodeRequest, context: grpc.aio.ServicerContext | None = None
    ) -> AsyncIterator[jetstream_pb2.DecodeResponse]:
        problem = decode_request_problem(request, self._tokenizer, self._limits)
        if problem is not None:
            if context is None:  # called in process, as JetStream's own tests do
                raise ValueError(problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if not self._limits.adds_bos:
            marked = jetstream_pb2.DecodeRequest()
            marked.CopyFrom(request)
            marked.session_cache = NO_BOS_SESSION
            request = marked
        async for response in super().Decode(request, context):
            yield response
