"""The one exception type for bad configuration."""


class ConfigError(ValueError):
    """A config value that is not allowed. The message is one line naming the field, the value and the rule."""
