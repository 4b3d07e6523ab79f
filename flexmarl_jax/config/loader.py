"""Load a config file (`PATH[:variant]`) and apply `--config.KEY=VALUE` overrides.

Follows the absl/ml-collections convention: a config file defines `get_config(variant=None)`; overrides are
dotted paths into the returned ConfigDict and are parsed into the type of the field they replace.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import ml_collections

from flexmarl_jax.config.errors import ConfigError

DEFAULT_CONFIG = "flexmarl_jax.configs.tiny"


def load_config(spec: str | None = None) -> ml_collections.ConfigDict:
    """Loads `spec` = `PATH[:variant]` (a .py file) or a module name; None loads the embedded default."""
    spec = spec or DEFAULT_CONFIG
    location, _, variant = spec.partition(":")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ConfigError(f"--config={spec}: file {location!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_flexmarl_config_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ConfigError(f"--config={spec}: cannot import config module {location!r} ({error})") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config={spec}: {location!r} defines no get_config(variant=None)")
    try:
        config = module.get_config(variant or None)
    except ValueError as error:
        raise ConfigError(f"--config={spec}: {error}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"--config={spec}: get_config returned {type(config).__name__}, not a ConfigDict")
    return config


def _parse_value(key: str, text: str, current):
    """Parses `text` into the type of the field's current value."""
    if isinstance(current, bool):
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config.{key}={text!r} is not a bool; allowed: true, false")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"config.{key}={text!r} is not an int") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"config.{key}={text!r} is not a float") from None
    if isinstance(current, str) or current is None:
        return text
    if isinstance(current, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"config.{key}={text!r} is not a {type(current).__name__} literal") from None
        return type(current)(value if isinstance(value, (tuple, list)) else (value,))
    raise ConfigError(f"config.{key} holds a {type(current).__name__}, which the command line cannot override")


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> ml_collections.ConfigDict:
    """Sets each dotted `key` to `value` (a string parsed into the field's type); unknown keys are errors."""
    for key, text in overrides.items():
        node = config
        parts = key.split(".")
        for depth, part in enumerate(parts):
            is_leaf = depth == len(parts) - 1
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                parent = ".".join(parts[:depth]) or "config"
                known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
                raise ConfigError(f"unknown config key {key!r}: {parent!r} has no field {part!r}; known: {known}")
            if is_leaf:
                if isinstance(node[part], ml_collections.ConfigDict):
                    raise ConfigError(f"config.{key} is a section, not a value; set one of its fields")
                with node.unlocked():
                    node[part] = _parse_value(key, text, node[part])
            else:
                node = node[part]
    return config
