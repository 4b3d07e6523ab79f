"""One agent of a `flexmarl train` run, loaded for serving, and the `FlexEngine` that serves it.

    run = read_run(workdir)                                   # its RunConfig (config.json)
    agent = load_agent(workdir, "solver", run=run)            # latest policy version, its tokenizer
    engine = build_engine(agent, serving_engine_config(run, "solver"), jax.devices()[0])

Only the policy parameters are read (`train.checkpoint.restore_policy`, through export's check that the agent's
model source still describes the checkpoint): no trainer, no optimizer state. The engine's shapes follow the
run (`rollout.max_prompt_length`, `rollout.max_response_length`, the agent's decode slots), except that its
longest prompt is rounded up to a power of two from 16 to 32768: JetStream's `pad_tokens` pads prompts to
those lengths only, and asks the engine for exactly `max_prefill_length` as its last bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.functional import param_shardings
from flexmarl_jax.models.lora import AdaptedParams, LoraSpec, adapter_table
from flexmarl_jax.orchestrator.export import (
    ExportError,
    agent_source,
    read_run_config,
    restore_matching_policy,
    saved_checkpoints,
)
from flexmarl_jax.rollout.engine import FlexEngine
from flexmarl_jax.rollout.settings import EngineConfig, engine_config_for
from flexmarl_jax.train.checkpoint import load_base

# The prompt lengths JetStream 0.2.2's token_utils.pad_tokens knows (its default prefill_lengths).
JETSTREAM_PREFILL_LENGTHS = tuple(2**power for power in range(4, 16))


class ServeError(Exception):
    """A bad workdir, agent, version or serving size; the message is one line naming the flag or field."""


@dataclasses.dataclass(frozen=True)
class ServedAgent:
    """One agent's policy at one version, as a checkpoint of the run holds it."""

    name: str
    policy_version: int
    model_config: ModelConfig
    graphdef: Any
    params: Any  # on one CPU device; `build_engine` places them (a LoRA agent's base with its adapter merged;
    # None when loaded unmerged for a base group's engine)
    tokenizer: Any  # models/tokenizer.py `Tokenizer`
    lora: LoraSpec | None = None  # a LoRA agent's spec, adapter and base record (`build_group_engine`)
    adapters: Any = None
    base_record: dict | None = None


def read_run(workdir: str):
    """The run's `RunConfig`; ServeError when WORKDIR holds no valid config.json."""
    try:
        return read_run_config(workdir)
    except ExportError as error:
        raise ServeError(str(error)) from None


def load_agent(workdir: str, agent: str, *, version: int | None = None, run=None, merged: bool = True
               ) -> ServedAgent:
    """``agent``'s policy at ``version`` (default: the latest checkpoint) from a run's workdir. ``merged=False``
    for a LoRA agent that a base group's engine serves (`build_group_engine`): its adapter only, params None.

    Raises ServeError for an unknown agent (naming the run's agents), a version that was not saved (naming the
    saved ones), or a checkpoint that no longer matches the agent's model.
    """
    run = read_run(workdir) if run is None else run
    try:
        source = agent_source(run, agent, workdir)
        checkpoints = saved_checkpoints(workdir, agent, version)
        snapshot = restore_matching_policy(checkpoints, version, source, agent, merged=merged)
    except ExportError as error:
        raise ServeError(str(error)) from None
    return ServedAgent(agent, snapshot.policy_version, snapshot.model_config, snapshot.graphdef, snapshot.params,
                       source.tokenizer, lora=snapshot.lora, adapters=snapshot.adapters, base_record=snapshot.base)


def jetstream_prefill_length(max_prompt_length: int) -> int:
    """The smallest prompt length JetStream pads to that holds ``max_prompt_length`` tokens."""
    for length in JETSTREAM_PREFILL_LENGTHS:
        if length >= max_prompt_length:
            return length
    raise ServeError(f"rollout.max_prompt_length={max_prompt_length} is longer than JetStream's longest prompt "
                     f"({JETSTREAM_PREFILL_LENGTHS[-1]} tokens)")


def serving_engine_config(run, agent: str, *, slots: int = 0, max_new_tokens: int = 0) -> EngineConfig:
    """The engine shapes for serving ``agent`` of ``run``: its decode slots and response length unless
    ``slots`` / ``max_new_tokens`` (> 0) say otherwise; prompts up to a JetStream prefill length."""
    if slots < 0:
        raise ServeError(f"--slots {slots} must be >= 0 (0: the run's decode slots)")
    if max_new_tokens < 0:
        raise ServeError(f"--max-new-tokens {max_new_tokens} must be >= 0 (0: rollout.max_response_length)")
    prefill = jetstream_prefill_length(run.rollout.max_prompt_length)
    shapes = engine_config_for(run, agent)  # the run's: slots, response length, the rest of the engine's settings
    return dataclasses.replace(shapes, max_concurrent_decodes=slots or shapes.max_concurrent_decodes,
                               max_prefill_length=prefill,
                               max_decode_length=max_new_tokens or shapes.max_decode_length,
                               prefill_buckets=tuple(n for n in JETSTREAM_PREFILL_LENGTHS if n <= prefill))


def check_jetstream_shapes(engine_config: EngineConfig, model_config: ModelConfig, agent: str) -> None:
    """ServeError unless JetStream's Driver can drive an engine of these shapes on this model."""
    if engine_config.max_prefill_length not in JETSTREAM_PREFILL_LENGTHS:
        raise ServeError(f"max_prefill_length={engine_config.max_prefill_length} of agent {agent!r} must be a power "
                         "of two from 16 to 32768 (JetStream pads prompts to those lengths only)")
    if engine_config.cache_length > model_config.max_position_embeddings:
        raise ServeError(f"agent {agent!r}: {engine_config.max_prefill_length} prompt + "
                         f"{engine_config.max_decode_length} new tokens exceed the model's max_position_embeddings="
                         f"{model_config.max_position_embeddings}; lower --max-new-tokens")


def build_engine(agent: ServedAgent, engine_config: EngineConfig, device: Any):
    """A greedy `FlexEngine` for ``agent`` on ``device`` with its parameters placed there.

    Returns (engine, params). Nothing is compiled yet: call `engine.warm_up(params)` before taking requests.
    """
    check_jetstream_shapes(engine_config, agent.model_config, agent.name)
    mesh = make_mesh([device], fsdp=1)
    params = jax.device_put(agent.params, param_shardings(agent.params, mesh))
    engine = FlexEngine(agent.model_config, agent.graphdef, engine_config, agent.tokenizer, mesh=mesh, params=params)
    return engine, params


def build_group_engine(agents: Sequence[ServedAgent], engine_config: EngineConfig, device: Any):
    """One `FlexEngine` for several LoRA agents of one base (a run's base group): the base once, read again from
    the record of the first agent's checkpoint (the agents may be loaded unmerged), and a table with two rows per
    agent (its current and spare rows, `rollout/adapter_rows.py`), both its adapter. Returns (engine,
    `AdaptedParams`); the agents' requests name their agent (`RolloutRequest.agent`) on an
    `EngineInstance(adapter_agents=...)`."""
    first = agents[0]
    if any(agent.lora is None or agent.base_record != first.base_record for agent in agents):
        raise ServeError(f"agents {[agent.name for agent in agents]} are not LoRA agents of one base")
    check_jetstream_shapes(engine_config, first.model_config, first.name)
    mesh = make_mesh([device], fsdp=1)
    graphdef, base = load_base(first.base_record, first.model_config, NamedSharding(mesh, PartitionSpec()))
    base = jax.device_put(base, param_shardings(base, mesh))
    rows = [jax.tree.map(np.asarray, agent.adapters) for agent in agents for _ in range(2)]
    table = adapter_table(rows, [agent.lora for agent in agents for _ in range(2)])
    params = AdaptedParams(base, jax.device_put(table, NamedSharding(mesh, PartitionSpec())))
    engine = FlexEngine(first.model_config, graphdef, engine_config, first.tokenizer, mesh=mesh, params=params)
    return engine, params
