"""Hugging Face checkpoint import/export: ``from_pretrained`` / ``save_pretrained``.

One table (`HF_NAME_TABLE`) maps every parameter path of `DecoderLM` to its HF tensor name and
the layout change between them; import and export both read it. Our weights are [in, ...out]
and head-structured ([embed, heads, head_dim]); HF stores torch Linear weights [out, in].

Files are read and written by the `safetensors` library (numpy API). Reading opens each file with
``safe_open`` and takes one tensor at a time (shapes come from the header, without reading data).
bfloat16 arrays are numpy arrays of ``ml_dtypes.bfloat16`` (what ``np.asarray`` gives for a jax
bf16 array): the library writes them as ``BF16`` and reads ``BF16`` back as ``ml_dtypes.bfloat16``,
bit for bit (tested in tests/models/test_checkpoint.py). safetensors 0.4.0 cannot read BF16 into
numpy; from 0.4.1 it can, once ml_dtypes is imported (jax imports it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import ExitStack
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.decoder import DecoderLM
from flexmarl_jax.models.functional import abstract_model, param_shardings
from flexmarl_jax.transfer import across_processes

logger = logging.getLogger(__name__)

# (our parameter path with {i} for the layer, HF tensor name, layout)
HF_NAME_TABLE: tuple[tuple[str, str, str], ...] = (
    ("embed.embedding", "model.embed_tokens.weight", "same"),
    ("final_norm.scale", "model.norm.weight", "same"),
    ("lm_head", "lm_head.weight", "transpose"),
    ("layers.{i}.input_norm.scale", "model.layers.{i}.input_layernorm.weight", "same"),
    ("layers.{i}.post_attention_norm.scale", "model.layers.{i}.post_attention_layernorm.weight", "same"),
    ("layers.{i}.attn.q_proj", "model.layers.{i}.self_attn.q_proj.weight", "in_to_heads"),
    ("layers.{i}.attn.k_proj", "model.layers.{i}.self_attn.k_proj.weight", "in_to_heads"),
    ("layers.{i}.attn.v_proj", "model.layers.{i}.self_attn.v_proj.weight", "in_to_heads"),
    ("layers.{i}.attn.o_proj", "model.layers.{i}.self_attn.o_proj.weight", "heads_to_out"),
    ("layers.{i}.attn.q_bias", "model.layers.{i}.self_attn.q_proj.bias", "same_flat"),
    ("layers.{i}.attn.k_bias", "model.layers.{i}.self_attn.k_proj.bias", "same_flat"),
    ("layers.{i}.attn.v_bias", "model.layers.{i}.self_attn.v_proj.bias", "same_flat"),
    ("layers.{i}.attn.q_norm.scale", "model.layers.{i}.self_attn.q_norm.weight", "same"),
    ("layers.{i}.attn.k_norm.scale", "model.layers.{i}.self_attn.k_norm.weight", "same"),
    ("layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.gate_proj.weight", "transpose"),
    ("layers.{i}.mlp.up_proj", "model.layers.{i}.mlp.up_proj.weight", "transpose"),
    ("layers.{i}.mlp.down_proj", "model.layers.{i}.mlp.down_proj.weight", "transpose"),
)
_BY_PATH = {ours: (hf, layout) for ours, hf, layout in HF_NAME_TABLE}
# HF tensors that carry no parameters of ours (buffers some exporters include).
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
# Header metadata of the files transformers writes (older transformers check the format).
_METADATA = {"format": "pt"}


class Pretrained(NamedTuple):
    """What `from_pretrained` returns; unpack as ``config, graphdef, params = ...``."""

    config: ModelConfig
    graphdef: Any
    params: nnx.State


def hf_name(path: tuple) -> tuple[str, str]:
    """Our flat parameter path, e.g. ('layers', 3, 'attn', 'q_proj') -> (HF name, layout)."""
    key = ".".join("{i}" if isinstance(p, int) else str(p) for p in path)
    if key not in _BY_PATH:
        raise KeyError(f"parameter {'.'.join(map(str, path))} has no row in HF_NAME_TABLE")
    layer = next((p for p in path if isinstance(p, int)), None)
    hf, layout = _BY_PATH[key]
    return hf.format(i=layer), layout


def _to_hf(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "same":
        return array
    if layout == "same_flat":  # [heads, head_dim] -> [heads * head_dim]
        return array.reshape(-1)
    if layout == "transpose":  # [in, out] -> [out, in]
        return array.T
    if layout == "in_to_heads":  # [embed, heads, head_dim] -> [heads * head_dim, embed]
        return array.reshape(array.shape[0], -1).T
    if layout == "heads_to_out":  # [heads, head_dim, embed] -> [embed, heads * head_dim]
        return array.reshape(-1, array.shape[-1]).T
    raise ValueError(f"unknown layout {layout!r}")


def _from_hf(array: np.ndarray, layout: str, our_shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("same", "same_flat"):
        return array.reshape(our_shape)
    if layout in ("transpose", "in_to_heads", "heads_to_out"):
        return array.T.reshape(our_shape)
    raise ValueError(f"unknown layout {layout!r}")


def _hf_shape(our_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return _to_hf(np.empty(our_shape, np.bool_), layout).shape


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from ``<path>/config.json`` (errors name unsupported architectures/fields)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {os.fspath(path)!r}")
    with open(config_path) as f:
        return ModelConfig.from_hf_config(json.load(f))


def _open_checkpoint(path: str, stack: ExitStack) -> dict[str, Any]:
    """HF tensor name -> the open ``safe_open`` handle of the file holding it (closed by `stack`).

    The files come from index.json if present, else every *.safetensors; opening reads headers only.
    """
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"no *.safetensors files in {path!r}")
        weight_map = None
    files = {
        name: stack.enter_context(safe_open(os.path.join(path, name), framework="numpy"))
        for name in (sorted(set(weight_map.values())) if weight_map is not None else names)
    }
    if weight_map is None:
        return {tensor: file for file in files.values() for tensor in file.keys()}
    keys = {name: set(file.keys()) for name, file in files.items()}
    for tensor, name in weight_map.items():
        if tensor not in keys[name]:
            raise ValueError(
                f"tensor {tensor!r} is listed in {_INDEX_FILE} but missing from {os.path.join(path, name)}"
            )
    return {tensor: files[name] for tensor, name in weight_map.items()}


def from_pretrained(path: str | os.PathLike, *, mesh: Mesh | None = None, dtype=jnp.float32) -> Pretrained:
    """Loads a local HF directory (config.json + one or several safetensors files).

    Each tensor is converted on the host and placed straight onto its shards of `mesh` (no
    replicated copy on device first). Raises ValueError naming the offending tensor for a wrong
    shape, a missing tensor or an unexpected one, and naming the architecture when unsupported.
    """
    path = os.fspath(path)
    config = read_hf_config(path)
    graphdef, abstract = abstract_model(config, dtype=dtype)
    shardings = param_shardings(abstract, mesh) if mesh is not None else None
    with ExitStack() as stack:
        located = _open_checkpoint(path, stack)
        flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}

        used: set[str] = set()
        loaded = []
        for our_path, variable in nnx.to_flat_state(abstract):
            name, layout = hf_name(our_path)
            if name not in located:
                raise ValueError(f"checkpoint {path!r} lacks tensor {name!r} (needed for {config.architecture})")
            expected = _hf_shape(variable.shape, layout)
            got = tuple(located[name].get_slice(name).get_shape())
            if got != expected:
                raise ValueError(f"tensor {name!r} in {path!r} has shape {list(got)}, expected {list(expected)}")
            # one tensor in host memory at a time; astype copies, so nothing refers to the file later
            host = _from_hf(located[name].get_tensor(name), layout, variable.shape).astype(variable.dtype)
            sharding = flat_shardings[our_path].get_value() if shardings is not None else None
            placed = jax.device_put(host) if sharding is None else across_processes.put(host, sharding)
            loaded.append((our_path, variable.replace(placed)))
            used.add(name)

        unexpected = sorted(
            n
            for n in located
            if n not in used
            and not _IGNORED_HF.match(n)
            and not (config.tie_word_embeddings and n == "lm_head.weight")
        )
        if unexpected:
            raise ValueError(
                f"checkpoint {path!r} has tensors this {config.architecture} model does not use: "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )
    return Pretrained(config, graphdef, nnx.from_flat_state(loaded))


def save_pretrained(model, path: str | os.PathLike, *, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Writes HF-compatible ``config.json`` and safetensors for `model` into directory `path`.

    `model` is a `DecoderLM`, a (graphdef, params) pair or a `Pretrained`. Above `max_shard_bytes`
    the weights are split into ``model-0000k-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. Returns the written file names.
    """
    if isinstance(model, Pretrained):
        model = nnx.merge(model.graphdef, model.params)
    elif isinstance(model, tuple):
        model = nnx.merge(*model)
    if not isinstance(model, DecoderLM):
        raise TypeError(
            f"save_pretrained needs a DecoderLM, (graphdef, params) or Pretrained, got {type(model)}"
        )
    config = model.config
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)

    tensors: dict[str, np.ndarray] = {}
    for our_path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, layout = hf_name(our_path)
        # contiguous is required: safetensors.numpy.save_file (0.8) writes a strided array's raw buffer
        tensors[name] = np.ascontiguousarray(_to_hf(np.asarray(jax.device_get(variable.get_value())), layout))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes

    hf_config = config.to_hf_config()
    dtypes = {a.dtype for a in tensors.values()}
    hf_config["torch_dtype"] = hf_config["dtype"] = (
        "bfloat16" if dtypes == {np.dtype(jnp.bfloat16)} else "float32"
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)

    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE_FILE), metadata=_METADATA)
        return ["config.json", _SINGLE_FILE]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, os.path.join(path, file), metadata=_METADATA)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    return ["config.json", *files, _INDEX_FILE]

