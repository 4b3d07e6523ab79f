"""Loading, overriding and validating ml-collections configs. Pure Python: never imports JAX."""

from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.loader import apply_overrides, load_config
from flexmarl_jax.config.validate import check_devices, devices_needed, validate_config

__all__ = ["ConfigError", "apply_overrides", "check_devices", "devices_needed", "load_config", "validate_config"]
