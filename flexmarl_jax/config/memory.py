"""Peak memory of each agent, estimated from shapes before anything is allocated, and the check that a team
fits the machine (one-line `ConfigError` naming the agent that does not).

    estimates = check_team_fits(config, {"solver": solver_model_config, ...})   # raises ConfigError

The estimate, for P parameters (`ModelConfig.num_params`), b bytes per element of the agent's dtype and
4 bytes for float32:

    params       P * b                                   the trained parameters
    optimizer    P * 4 (master copy, fp32_master_weights)
                 + moments * P * (4 with master weights, else b)      Adam(W): 2 moments, SGD: none
    grads        P * 4 + P * b                           float32 accumulator + one micro-batch's gradient
    activations  what the backward pass of one pass of R rows (train.rows_per_pass, else the micro-batch) x T
                 tokens keeps, L layers:
                   per layer   R*T * (b * (4h + 2*H*d + 2*K*d + 3m) + H*T*(4 + b))
                               (layer input, norms, q/k/v, attention output, residual, MLP gate/up/product;
                               float32 scores and dtype softmax weights over T keys per query head)
                   logits      R*T * V * 4 * 3           (float32 logits, softmax, their gradient)
                   no remat:   (L + 1) * per layer + logits   (+1: the backward pass's own working set)
                   remat:      L * R*T*h*b + 2 * per layer + logits   (layer inputs; one layer recomputed)
    rollout_params  instances * P * b                    each engine instance serves its own copy
    kv_cache     instances * (2 * L * slots * S * K * d * b + slots * V * 4)   k and v over S = cache length,
                                                         plus the float32 next-token logits of every slot

h = hidden size, H / K = query / KV heads, d = head dim, m = MLP width, V = vocabulary. A frozen reference
(KL on) adds P * b; a PPO critic doubles params, optimizer, grads and activations. A LoRA agent of A adapter
parameters (float32) adds A * 4 to params, and its optimizer state and grads count A at 4 bytes instead of P (its
KL reference is the base it already holds). A LoRA base group (config/lora_groups.py) holds one base per device
(`share_group_bases`): its agents decode on the leader's instances (one base and a table of 2 rows of A * 4 per
agent each), and on shared training slices the group keeps one base per slice it can reach plus one host copy,
where agents on meshes of their own each hold one.
This counts what a step holds at its peak, not XLA's exact buffer plan: within 35% of XLA's own figure at
small shapes (tests/config/test_memory.py), and the check leaves a margin.

Where it must fit. On a CPU host the fake XLA devices share the host's RAM, so the whole team must fit in
it (less a margin). On an accelerator, each agent's training state is spread over its training mesh and each
engine instance over its devices, and the larger share must fit one device; when the run binds more device
slots than exist (agents colocated), the team's total must fit all devices together.

Pure Python at import; `check_team_fits` imports JAX to ask the devices their memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexmarl_jax.config.devices import devices_needed
from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.lora_groups import lora_base_groups
from flexmarl_jax.models.dtypes import DTYPE_BYTES
from flexmarl_jax.models.lora_targets import adapter_parameter_count

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import RunConfig
    from flexmarl_jax.models.config import ModelConfig

GIB = 2**30
_FLOAT32 = 4
# Moment trees an optimizer keeps per parameter (train/optim.py registers these names).
OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 0}
# On a CPU host: keep this share of RAM (at least HOST_MARGIN_MIN_BYTES) for the OS, Python and the store.
HOST_MARGIN_FRACTION = 0.1
HOST_MARGIN_MIN_BYTES = 2 * GIB


@dataclasses.dataclass(frozen=True)
class AgentMemory:
    """Bytes one agent needs at its peak, by component (see the module docstring for each formula).

    `training` lives on the agent's training mesh, `rollout` on its engine instances' devices.
    """

    params: int
    optimizer: int
    grads: int
    activations: int
    rollout_params: int
    kv_cache: int

    @property
    def training(self) -> int:
        return self.params + self.optimizer + self.grads + self.activations

    @property
    def rollout(self) -> int:
        return self.rollout_params + self.kv_cache

    @property
    def total(self) -> int:
        return self.training + self.rollout

    def breakdown(self) -> str:
        """'params 0.9, optimizer 3.7, ... GiB' (one line)."""
        parts = [f"{name.replace('_', ' ')} {getattr(self, name) / GIB:.1f}"
                 for name in ("params", "optimizer", "grads", "activations", "rollout_params", "kv_cache")]
        return ", ".join(parts) + " GiB"


def estimate_agent_memory(model_config: ModelConfig, *, dtype: str, fp32_master_weights: bool,
                          optimizer: str = "adam", train_rows: int, train_len: int, remat: bool,
                          decode_slots: int, cache_length: int, instances: int, reference: bool = False,
                          critic: bool = False, adapter_params: int = 0) -> AgentMemory:
    """Peak bytes of one agent: its trainer (micro-batches of `train_rows` x `train_len` tokens) and its
    `instances` engine instances (`decode_slots` sequences of `cache_length` positions each).

    reference: a frozen reference model is kept (KL on); critic: a PPO critic (a second network) is trained.
    adapter_params: a LoRA agent's adapter size (0: the whole model is trained).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not allowed; choose one of: {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed; choose one of: {', '.join(OPTIMIZER_MOMENTS)}")
    m = model_config
    count, width = m.num_params(), DTYPE_BYTES[dtype]
    networks = 2 if critic else 1

    if adapter_params:  # float32 adapters are trained; the base is frozen and is the KL's reference
        params = count * width + adapter_params * _FLOAT32
        optimizer_bytes = OPTIMIZER_MOMENTS[optimizer] * adapter_params * _FLOAT32
        grads = adapter_params * 2 * _FLOAT32
    else:
        params = count * width * networks + (count * width if reference else 0)
        moment_width = _FLOAT32 if fp32_master_weights else width
        master = count * _FLOAT32 if fp32_master_weights else 0
        optimizer_bytes = (master + OPTIMIZER_MOMENTS[optimizer] * count * moment_width) * networks
        grads = count * (_FLOAT32 + width) * networks

    tokens = train_rows * train_len
    per_token = width * (4 * m.hidden_size + 2 * m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim
                         + 3 * m.intermediate_size)
    per_layer = tokens * (per_token + m.num_heads * train_len * (_FLOAT32 + width))
    logits = tokens * m.vocab_size * _FLOAT32 * 3
    if remat:
        activations = m.num_layers * tokens * m.hidden_size * width + 2 * per_layer + logits
    else:
        activations = (m.num_layers + 1) * per_layer + logits

    cache = 2 * m.num_layers * decode_slots * cache_length * m.num_kv_heads * m.head_dim * width
    next_logits = decode_slots * m.vocab_size * _FLOAT32
    return AgentMemory(params=params, optimizer=optimizer_bytes, grads=grads, activations=activations * networks,
                       rollout_params=instances * count * width, kv_cache=instances * (cache + next_logits))


def agent_memory(config: RunConfig, agent: str, model_config: ModelConfig) -> AgentMemory:
    """`estimate_agent_memory` for ``agent`` of a run: its dtype, master weights and decode slots, the run's
    micro-batch, lengths, remat and instances, and the algorithm's reference model or critic."""
    # lazy: train.from_config imports JAX (import jax costs ~1 s); importing the config must not (tests/config)
    from flexmarl_jax.train.from_config import run_loss_config

    settings, rollout = config.agents[agent], config.rollout
    loss = run_loss_config(config)
    length = rollout.max_prompt_length + rollout.max_response_length
    return estimate_agent_memory(
        model_config, dtype=settings.dtype, fp32_master_weights=settings.fp32_master_weights, optimizer="adamw",
        train_rows=config.train.rows_per_pass or config.train.micro_batch_size, train_len=length,
        remat=config.train.remat,
        decode_slots=settings.decode_slots or rollout.decode_slots, cache_length=length,
        instances=rollout.instances_per_agent, reference=loss.kl_coef > 0, critic=loss.needs_values,
        adapter_params=adapter_parameter_count(model_config, settings.lora.rank, settings.lora.target_names))


def share_group_bases(config: RunConfig, estimates: Mapping[str, AgentMemory],
                      model_configs: Mapping[str, ModelConfig], *, host_copy: bool) -> dict[str, AgentMemory]:
    """The estimates with each LoRA base group's base counted once per device (module docstring): a follower's
    rollout and, on shared training slices, its base move to the group's leader. `host_copy`: count the group's
    host copy of the base (shared slices keep one; it is in the device pool only on a CPU host)."""
    adjusted = dict(estimates)
    for leader, group in _groups(config, estimates).items():
        m, settings = model_configs[leader], config.agents[leader]
        base = m.num_params() * DTYPE_BYTES[settings.dtype]
        adapters = [adapter_parameter_count(model_configs[a], config.agents[a].lora.rank,
                                            config.agents[a].lora.target_names) for a in group]
        table = config.rollout.instances_per_agent * 2 * sum(adapters) * _FLOAT32  # a current and a spare row
        slices = config.mesh.train_slices
        leader_params = adjusted[leader].params
        if slices:
            leader_params += base * (min(slices, len(group)) - 1 + (1 if host_copy else 0))
        adjusted[leader] = dataclasses.replace(adjusted[leader], params=leader_params,
                                               rollout_params=adjusted[leader].rollout_params + table)
        for follower in group[1:]:
            params = adjusted[follower].params - (base if slices else 0)
            adjusted[follower] = dataclasses.replace(adjusted[follower], params=params, rollout_params=0, kv_cache=0)
    return adjusted


def _groups(config: RunConfig, estimates: Mapping[str, AgentMemory]) -> dict[str, tuple[str, ...]]:
    """leader -> its LoRA base group, among the estimated agents (in their order)."""
    groups = lora_base_groups(config, order=list(estimates))
    return {group[0]: group for group in groups.values() if len(group) > 1}


def host_memory_bytes() -> int:
    """The host's physical RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_team_fits(config: RunConfig, model_configs: Mapping[str, ModelConfig], available_bytes: int | None = None,
                    *, platform: str | None = None) -> dict[str, AgentMemory]:
    """Raises a one-line ConfigError naming the agent when the team cannot fit in memory; else returns each
    agent's estimate.

    model_configs: agent -> its model's shapes (every agent of the team).
    available_bytes: the memory to check against; default the host's RAM less a margin on CPU, one device's
        `bytes_limit` on an accelerator (no check when the device does not report it).
    platform: "cpu" or an accelerator's name; default JAX's backend.
    """
    estimates = {agent: agent_memory(config, agent, model_config) for agent, model_config in model_configs.items()}
    if platform is None:
        # lazy: importing the config must not load JAX (import jax costs ~1 s; tests/config/test_schema.py)
        import jax

        platform = jax.default_backend()
    estimates = share_group_bases(config, estimates, model_configs, host_copy=platform == "cpu")
    if platform == "cpu":
        if available_bytes is None:
            total = host_memory_bytes()
            available_bytes = total - max(int(total * HOST_MARGIN_FRACTION), HOST_MARGIN_MIN_BYTES)
        _check_shared(config, estimates, available_bytes, "of host memory (the fake CPU devices share it)")
        return estimates
    if available_bytes is None:
        available_bytes = _device_bytes_limit()
        if available_bytes is None:
            return estimates
    _check_devices(config, estimates, available_bytes)
    return estimates


def _describe(config: RunConfig, agent: str, memory: AgentMemory) -> str:
    settings = config.agents[agent]
    return (f"config.agents.{agent} ({settings.model}, {settings.dtype}) needs ~{memory.total / GIB:.1f} GiB "
            f"({memory.breakdown()})")


def _check_shared(config: RunConfig, estimates: Mapping[str, AgentMemory], available_bytes: int, where: str) -> None:
    """Every agent's memory is one pool: the team's total must fit `available_bytes`."""
    team = sum(memory.total for memory in estimates.values())
    if team <= available_bytes:
        return
    largest = max(estimates, key=lambda agent: estimates[agent].total)
    team_note = "" if len(estimates) == 1 else f"; with the other agents the team needs ~{team / GIB:.1f} GiB"
    raise ConfigError(f"{_describe(config, largest, estimates[largest])}{team_note} {where} but "
                      f"{available_bytes / GIB:.1f} GiB are available")


def _check_devices(config: RunConfig, estimates: Mapping[str, AgentMemory], bytes_per_device: int) -> None:
    """Each agent's training share and instance share against one device's memory."""
    # lazy: importing the config must not load JAX (import jax costs ~1 s; tests/config/test_schema.py)
    import jax

    device_count = len(jax.devices())
    if config.mesh.colocate or devices_needed(config) > device_count:  # colocated agents share every device
        _check_shared(config, estimates, bytes_per_device * device_count,
                      f"on the {device_count} device(s) its agents share")
        return
    mesh, rollout = config.mesh, config.rollout
    for agent, memory in estimates.items():
        training = memory.training // mesh.train_devices_per_agent
        instance = memory.rollout // (rollout.instances_per_agent * mesh.rollout_devices_per_instance)
        if training > bytes_per_device or instance > bytes_per_device:
            share = (f"~{training / GIB:.1f} GiB per device of its training mesh "
                     f"(mesh.train_devices_per_agent={mesh.train_devices_per_agent})" if training >= instance else
                     f"~{instance / GIB:.1f} GiB per device of an engine instance "
                     f"(mesh.rollout_devices_per_instance={mesh.rollout_devices_per_instance})")
            raise ConfigError(f"{_describe(config, agent, memory)}, {share}, but {bytes_per_device / GIB:.1f} GiB "
                              "are available on each device")


def _device_bytes_limit() -> int | None:
    """The smallest `bytes_limit` of the accelerator devices (None when they do not report one)."""
    # lazy: importing the config must not load JAX (import jax costs ~1 s; tests/config/test_schema.py)
    import jax

    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in jax.devices()]
    return min(limits) if limits and None not in limits else None
