"""Model configuration for the Qwen2 / Llama / Qwen3 decoder family.

Pure Python (no JAX import): the config package validates model choices with it.
`ModelConfig.from_hf_config` reads a Hugging Face ``config.json`` dict (transformers v4
``rope_theta``/``rope_scaling`` fields as well as v5 ``rope_parameters``);
`ModelConfig.to_hf_config` writes one that transformers loads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Architecture name (HF ``architectures[0]``) -> HF ``model_type``.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPE_TO_ARCHITECTURE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

# RoPE variants we implement; "default" means plain RoPE (no scaling).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only LM.

    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` ("linear" with
    ``factor``, or "llama3" with ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    architecture: str = "Qwen2ForCausalLM"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (rotary embeddings)")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; allowed: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta} must be > 0")
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)

    # A dict field makes the generated hash fail; configs are static jit arguments (inside the
    # NNX graphdef), so hash a canonical JSON form instead.
    def __hash__(self) -> int:
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def num_params(self) -> int:
        """Parameter count computed from the shapes (equals `functional.param_count`)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + embed + head + h

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a HF ``config.json`` dict; errors name unsupported fields."""
        architectures = hf.get("architectures") or []
        if architectures:
            architecture = architectures[0]
        elif hf.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
            architecture = _MODEL_TYPE_TO_ARCHITECTURE[hf["model_type"]]
        else:
            raise ValueError(
                "config.json names no architecture (no 'architectures' list and model_type="
                f"{hf.get('model_type')!r}); supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architecture {architecture!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=True is not supported")
        if model_type == "qwen2":
            qkv_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj).
            if hf.get("use_sliding_window"):
                raise ValueError("config.json use_sliding_window=True is not supported")
        else:
            if hf.get("attention_bias"):
                raise ValueError(
                    f"config.json attention_bias=True is not supported for {architecture} "
                    "(it would add an o_proj bias)"
                )
            qkv_bias = False

        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _parse_rope(hf)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            architecture=architecture,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A HF ``config.json`` dict (both v4 and v5 rope fields, so either transformers loads it)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "rope_parameters": rope_parameters,
            "torch_dtype": "float32",
            "dtype": "float32",
        }
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = False
        else:
            hf["attention_bias"] = False
            hf["mlp_bias"] = False
        return hf


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """Returns (rope_theta, rope_scaling or None) from v4 or v5 HF rope fields."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
    if theta is None:
        theta = 10000.0
    if scaling is None:
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:  # older configs spell it "type"
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    _validate_rope_scaling(scaling)
    return theta, scaling


def _validate_rope_scaling(scaling: dict) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES or rope_type == "default":
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; allowed: 'linear', 'llama3' "
            "(or no rope_scaling)"
        )
    required = ("factor",) if rope_type == "linear" else _LLAMA3_ROPE_KEYS
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}; got {scaling}")
