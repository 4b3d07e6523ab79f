"""The config's registry lookups and value rules, one function each (a rule returns why a value is wrong, or
None): the registries' names come from the packages that own them, looked up when a config is checked, so
importing the config stays free of JAX and fast.
"""

from __future__ import annotations

import functools
import os
import re

from flexmarl_jax.models import presets
from flexmarl_jax.store.backends import STORE_BACKENDS
from flexmarl_jax.train.algorithm_names import ALGORITHM_NAMES

# ------------------------------------------------------------------------------------ registries


def workflow_names() -> list[str]:
    # lazy: workflows/ costs 72 ms; `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.workflows.builtin import WORKFLOW_BUILDERS

    return sorted(WORKFLOW_BUILDERS)


def store_backends() -> tuple[str, ...]:
    return STORE_BACKENDS


def algorithm_names() -> tuple[str, ...]:
    return ALGORITHM_NAMES


def warmup_kinds() -> list[str]:
    # lazy: workflows/ costs 72 ms; `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.workflows.warmup_data import WARMUP_KINDS

    return sorted(WARMUP_KINDS)


def task_rule(task: str) -> str | None:
    """A registered task, or a path ending in .jsonl (read by the `jsonl` task)."""
    # lazy: workflows/ costs 72 ms; `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.workflows.tasks import TASK_BUILDERS

    if task.endswith(".jsonl") or task in TASK_BUILDERS and task != "jsonl":
        return None
    names = sorted(set(TASK_BUILDERS) - {"jsonl"})
    return f"is not allowed; choose one of: {', '.join(names)} or a path ending in .jsonl"


def directory_stamp(path: str) -> tuple:
    """Names and modification times of a directory's files: what says it changed since it was last checked."""
    with os.scandir(path) as entries:
        return tuple(sorted((entry.name, entry.stat().st_mtime_ns) for entry in entries))


@functools.lru_cache(maxsize=64)
def checkpoint_problem(path: str, stamp: tuple) -> str | None:
    """Why a checkpoint directory cannot be used, or None; cached per directory state, since a config is
    rebuilt (and every field re-checked) each time a field changes, and reading a tokenizer takes a while."""
    del stamp  # part of the cache key only
    # lazy: hf_directory loads jinja2 and tokenizers (57 ms); `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.models.hf_directory import inspect_checkpoint_dir

    try:
        inspect_checkpoint_dir(path)
    except (ValueError, OSError) as error:
        return f"is not a usable checkpoint: {error}"
    return None


def emulate_rule(text: str) -> str | None:
    """Empty (off) or CHIP:MODEL that `emulation.parse_emulate` accepts; its error names the choices."""
    if text == "":
        return None
    # lazy: the emulation package costs 16 ms; `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.emulation.spec import parse_emulate

    try:
        parse_emulate(text)
    except ValueError as error:
        return f"is not usable: {error}"
    return None


def emulate_link_rule(name: str) -> str | None:
    """A link of `emulation.chips.LINKS` or "interconnect" (the emulated chip's own ICI / NVLink)."""
    # lazy: the emulation package costs 16 ms; `flexmarl --help` (~0.1 s) checks no config
    from flexmarl_jax.emulation.chips import LINKS

    if name == "interconnect" or name in LINKS:
        return None
    return f"is not a link; choose one of: interconnect, {', '.join(sorted(LINKS))}"


# The `pipeline.emulate_*` rules are emulation/rules.py's, which a directly built CostModel, TimeScale and
# EmulatedEngine check too. lazy: the emulation package costs 16 ms; `flexmarl --help` (~0.1 s) checks no config


def emulate_mfu_rule(mfu: float) -> str | None:
    from flexmarl_jax.emulation.rules import mfu_problem

    return mfu_problem(mfu)


def emulate_compression_rule(compression: float) -> str | None:
    from flexmarl_jax.emulation.rules import compression_problem

    return compression_problem(compression)


def emulate_tokens_per_call_rule(tokens_per_call: int) -> str | None:
    from flexmarl_jax.emulation.rules import tokens_per_call_problem

    return tokens_per_call_problem(tokens_per_call)


def regex_rule(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as error:
        return f"is not a valid regular expression ({error})"
    return None


def model_rule(model: str) -> str | None:
    """A model preset or a local Hugging Face checkpoint directory whose config, tokenizer and weight files
    are there and fit each other (read without loading weights)."""
    if os.path.isdir(model):
        return checkpoint_problem(os.path.abspath(model), directory_stamp(model))
    if model in presets.PRESETS:
        return None
    return f"is neither a model preset nor a checkpoint directory; presets: {', '.join(sorted(presets.PRESETS))}"


def coordinator_address_rule(address: str) -> str | None:
    """"" (auto-detected on Cloud TPU), or HOST:PORT with a port number."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return None
    return "must be HOST:PORT (e.g. 10.0.0.2:8476) or \"\" to auto-detect it on Cloud TPU"


def workdir_rule(workdir: str) -> str | None:
    """A local path, file://, or an object store Orbax and TensorStore write to (gs://, s3://)."""
    if not workdir:
        return "must not be empty"
    scheme = workdir.split("://", 1)[0] if "://" in workdir else ""
    if scheme and scheme not in ("gs", "s3"):
        return f"has scheme {scheme}://; allowed: a path, file:///ABS/PATH, gs://bucket/path"
    return None
