"""Load a config file (`PATH[:variant]`) or module into an ml-collections ConfigDict.

Follows the absl/ml-collections convention: a config file defines `get_config(variant=None)`; the variant is
everything after the first colon (comma-separated names combine). `--config.KEY=VALUE` overrides are applied by
`cli_flags` (ml_collections.config_flags); `schema.RunConfig.from_config` turns the result into the typed config.
"""

from __future__ import annotations

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
