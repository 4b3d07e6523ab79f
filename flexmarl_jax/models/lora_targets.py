"""The projections a LoRA adapter may target, and the config's spelling of a choice of them.

Pure Python (no JAX import): the config checks `agents.<name>.lora.targets` with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexmarl_jax.models.config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Every decoder this package supports (models/config.py SUPPORTED_ARCHITECTURES) has these seven projections.
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ALL = "all"


def parse_targets(text: str) -> tuple[str, ...]:
    """The targets of a comma-separated list ("q_proj,v_proj"), or all seven for "all", in TARGETS order;
    ValueError naming what is not a projection, is repeated, or is empty."""
    if text.strip() == ALL:
        return TARGETS
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError(f"has an empty name; give comma-separated projections or {ALL!r}")
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        raise ValueError(f"names {', '.join(unknown)}, which the Qwen2, Llama and Qwen3 decoders lack; choose "
                         f"among {', '.join(TARGETS)} or {ALL!r}")
    if len(set(names)) != len(names):
        raise ValueError("names a projection twice")
    return tuple(name for name in TARGETS if name in names)


def targets_problem(text: str) -> str | None:
    """The config rule of `lora.targets`: None when it parses, else why not."""
    try:
        parse_targets(text)
    except ValueError as error:
        return str(error)
    return None


def adapter_parameter_count(model_config: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """Elements of a rank-`rank` adapter on `targets` (A is in x r and B r x out, per layer): the memory
    estimate's figure, equal to `lora.adapter_count` of a real adapter."""
    m = model_config
    attention_out = {"q_proj": m.num_heads * m.head_dim, "k_proj": m.num_kv_heads * m.head_dim,
                     "v_proj": m.num_kv_heads * m.head_dim}
    sizes = {name: (m.hidden_size, width) for name, width in attention_out.items()}
    sizes.update(o_proj=(m.num_heads * m.head_dim, m.hidden_size), gate_proj=(m.hidden_size, m.intermediate_size),
                 up_proj=(m.hidden_size, m.intermediate_size), down_proj=(m.intermediate_size, m.hidden_size))
    return m.num_layers * rank * sum(sum(sizes[target]) for target in targets)
