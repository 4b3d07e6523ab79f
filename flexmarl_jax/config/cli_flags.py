"""The `flexmarl train` command line, parsed by absl flags and ml_collections.config_flags.

    --config=PATH[:VARIANT[,VARIANT...]]  a config file or module (default: the embedded flexmarl_jax.configs.tiny)
    --config.KEY=VALUE                    one field, parsed by config_flags into the type of its current value
    --workdir=DIR                         the run directory (default: config.workdir)
    --gantt-iterations=K                  the Gantt chart draws the last K iterations (0: the whole run); how
                                          a run is shown, not what it does, so a flag and not a config field
    --verbosity=N, -v N                   absl's log-level flag: -1 warnings (default), 0 info, 1 debug

`apply_overrides` applies `KEY=VALUE` strings to a ConfigDict through the same library path. Traps handled:
- the flags live on a fresh `absl.flags.FlagValues()` per call and config_flags gets the argv to parse
  (`sys_argv`): by default it reads `sys.argv`, which would silently drop the overrides of `main(argv)`;
- `--config=SPEC` is loaded by `load_config` (module names, variants, one-line errors), installed as the
  config flag's parser, and the override keys are checked against the loaded config before config_flags
  defines a flag for each (it raises a bare KeyError for an unknown key); its value errors become
  `config.KEY='VALUE' is not an int`-style lines;
- `--config.KEY VALUE` (a space) is joined into `--config.KEY=VALUE` first: absl reads the word after a
  boolean flag as a positional argument, so `--config.pipeline.balancing false` would otherwise set True;
- config_flags rejects overrides before `--config=`: the spec is moved to the front.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence

import ml_collections
from absl import flags
from absl.logging import converter
from ml_collections import config_flags

from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.fields import is_section, walk_fields
from flexmarl_jax.config.loader import DEFAULT_CONFIG, load_config
from flexmarl_jax.config.schema import RunConfig

CONFIG = "config"
GANTT_ITERATIONS = "gantt-iterations"
_OVERRIDE = re.compile(r"^--?(?P<no>no)?config\.(?P<key>[^=]+)(?:=(?P<value>.*))?$", re.DOTALL)
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_TYPE_NAMES = {bool: "a bool; allowed: true, false", int: "an int", float: "a float", str: "a str"}


@dataclasses.dataclass(frozen=True)
class TrainFlags:
    """What `flexmarl train` was given: the loaded config with its overrides applied (still a ConfigDict)."""

    config: ml_collections.ConfigDict
    workdir: str | None
    verbosity: int | None  # absl verbosity, when --verbosity was given
    gantt_iterations: int | None = None  # --gantt-iterations, when given (None: the plots' default)

    @property
    def log_level(self) -> int | None:
        """The Python logging level of `verbosity` (absl's mapping; above 1 is debug)."""
        if self.verbosity is None:
            return None
        return logging.DEBUG if self.verbosity >= 1 else converter.absl_to_standard(max(self.verbosity, -3))


def parse_train_flags(argv: Sequence[str]) -> TrainFlags:
    """Parses `flexmarl train`'s arguments; raises ConfigError (one line) on anything it cannot use."""
    # --flagfile=PATH expanded first, so that the overrides it holds are checked like the others.
    spec, rest, overrides = _normalize(flags.FlagValues().read_flags_from_files(list(argv), force_gnu=False))
    argv = ["flexmarl train", f"--{CONFIG}={spec or DEFAULT_CONFIG}", *rest]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(CONFIG, None, "config file or module[:variant]", flag_values=values,
                                    sys_argv=argv)
    parser = values[CONFIG].parser = _ConfigSpecParser(overrides)
    workdir = flags.DEFINE_string("workdir", None, "run directory (default: config.workdir)", flag_values=values)
    gantt = flags.DEFINE_integer(GANTT_ITERATIONS, None, "the Gantt chart draws the last K iterations (0: all)",
                                 lower_bound=0, flag_values=values)
    verbosity = _define_verbosity(values)
    unparsed = _parse(values, argv, overrides, lambda: parser.config)
    if unparsed[1:]:
        raise ConfigError(f"unexpected argument(s) {unparsed[1:]}; flexmarl train takes only flags "
                          "(--config=..., --config.KEY=VALUE, --workdir=..., --gantt-iterations=..., --verbosity=...)")
    return TrainFlags(values[CONFIG].value, workdir.value, verbosity.value if verbosity.present else None,
                      gantt.value)


def train_help() -> str:
    """`flexmarl train --help`: the flags, then every config field with its description and default."""
    lines = ["usage: flexmarl train [--config=PATH[:VARIANT[,VARIANT...]]] [--config.KEY=VALUE ...] "
             "[--workdir=DIR] [--gantt-iterations=K] [--verbosity=N]",
             "",
             "  --config=PATH[:VARIANT]  config file or module (default: the embedded configs/tiny.py); its VARIANTS",
             "  --config.KEY=VALUE       set one field (also --config.KEY VALUE), parsed into the field's type",
             "  --workdir=DIR            run directory (default: config.workdir)",
             "  --gantt-iterations=K     plots/gantt.png draws the last K iterations (default 3; 0: the whole run)",
             "  --verbosity=N, -v N      log level: -1 warnings (default), 0 info, 1 debug",
             "",
             "config fields (the defaults of configs/tiny.py; config files may set them differently):"]
    for name, field in walk_fields(RunConfig):
        default = "" if is_section(field.type) or field.default is dataclasses.MISSING else f" [{field.default!r}]"
        choices = field.metadata["choices"]
        allowed = f" {{{', '.join(choices())}}}" if choices is not None else ""
        lines.append(f"  {name}: {field.metadata['help']}{allowed}{default}")
    return "\n".join(lines)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, str]) -> ml_collections.ConfigDict:
    """Sets each dotted `key` to `value`, parsed by config_flags into the field's type exactly as
    `--config.KEY=VALUE` is; unknown keys and bad values raise ConfigError. Returns `config` (changed)."""
    overrides = {key: str(value) for key, value in overrides.items()}
    check_override_keys(config, overrides)
    argv = ["apply_overrides", *(f"--{CONFIG}.{key}={value}" for key, value in overrides.items())]
    values = flags.FlagValues()
    try:
        config_flags.DEFINE_config_dict(CONFIG, config, flag_values=values, sys_argv=argv, lock_config=False)
    except (flags.Error, ValueError, TypeError) as error:
        raise _one_line(error, overrides, config) from None
    _parse(values, argv, overrides, lambda: config)
    return config


def check_override_keys(config: ml_collections.ConfigDict, keys) -> None:
    """Raises ConfigError unless every dotted key names a value (not a section) of `config`."""
    for key in keys:
        node, parts = config, key.split(".")
        for depth, part in enumerate(parts):
            parent = ".".join(parts[:depth]) or "config"
            if not isinstance(node, ml_collections.ConfigDict):
                raise ConfigError(f"unknown config key {key!r}: {parent!r} is a value, not a section")
            if part not in node:
                raise ConfigError(f"unknown config key {key!r}: {parent!r} has no field {part!r}; "
                                  f"known: {', '.join(sorted(node.keys()))}")
            node = node[part]
        if isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"config.{key} is a section, not a value; set one of its fields")


class _ConfigSpecParser(flags.ArgumentParser):
    """The config flag's parser: `load_config(SPEC)`, then the override keys checked against the result."""

    def __init__(self, override_keys):
        self.override_keys = list(override_keys)
        self.config: ml_collections.ConfigDict | None = None

    def parse(self, argument: str) -> ml_collections.ConfigDict:
        config = load_config(argument)
        check_override_keys(config, self.override_keys)
        self.config = config
        return config

    def flag_type(self) -> str:
        return "config object"


def _define_verbosity(values: flags.FlagValues) -> flags.Flag:
    """absl.logging's -v/--verbosity flag (its class: setting it sets absl's log level) on `values`."""
    absl_flag = flags.FLAGS["verbosity"]
    flag = type(absl_flag)(name="verbosity", default=-1, help_string=absl_flag.help, short_name="v")
    flags.DEFINE_flag(flag, values)
    return flag


def _normalize(argv: Sequence[str]) -> tuple[str | None, list[str], dict[str, str]]:
    """(the last --config spec, the other arguments with `--config.KEY VALUE` joined by '=', and each
    override key with the text given for it)."""
    spec, rest, overrides = None, [], {}
    items = list(argv)
    index = 0
    while index < len(items):
        item, following = items[index], items[index + 1] if index + 1 < len(items) else None
        match = _OVERRIDE.match(item)
        if item in ("--config", "-config") and following is not None:
            item, index = f"--{CONFIG}={following}", index + 1
        elif match and match["value"] is None and not match["no"] and following is not None and (
                not following.startswith("-") or _NUMBER.match(following)):
            item, index = f"{item}={following}", index + 1
        index += 1
        if item.startswith(("--config=", "-config=")):
            spec = item.split("=", 1)[1]
            continue
        match = _OVERRIDE.match(item)
        if match:
            value = match["value"]
            overrides[match["key"]] = "false" if match["no"] else "true" if value is None else value
        rest.append(item)
    return spec, rest, overrides


def _parse(values: flags.FlagValues, argv: list[str], overrides: Mapping[str, str], config_of) -> list[str]:
    try:
        return values(argv)
    except (flags.Error, ValueError, TypeError, KeyError, AttributeError) as error:
        raise _one_line(error, overrides, config_of()) from None


def _one_line(error: Exception, overrides: Mapping[str, str], config) -> ConfigError:
    """The error a flag-parsing failure stands for, as one ConfigError line naming field, value and rule."""
    cause = error
    while cause is not None:  # our own error, raised inside a parser and wrapped by absl
        if isinstance(cause, ConfigError):
            return cause
        cause = cause.__context__
    message = str(error).strip()
    for key, value in overrides.items():
        if message.startswith(f"flag --{CONFIG}.{key}="):
            current = _value_at(config, key)
            kind = _TYPE_NAMES.get(type(current))
            if kind is not None:
                return ConfigError(f"config.{key}={value!r} is not {kind}")
            return ConfigError(f"config.{key}={value!r}: {message.split(': ', 1)[-1]}")
    gantt = re.match(rf"^flag --{GANTT_ITERATIONS}=(.*?): ", message)
    if gantt:
        return ConfigError(f"--{GANTT_ITERATIONS}={gantt[1]!r} is not an int >= 0: the iterations the Gantt chart "
                           "draws (0: the whole run)")
    missing = re.match(r"^Missing value for flag (--\S+)$", message)
    if missing:
        return ConfigError(f"{missing[1]} needs a value: {missing[1]}=VALUE")
    if isinstance(error, flags.UnrecognizedFlagError):
        return ConfigError(f"unknown flag --{error.flagname}; flexmarl train takes --config=PATH[:VARIANT], "
                           "--config.KEY=VALUE, --workdir=DIR, --gantt-iterations=K and --verbosity=N")
    return ConfigError(" ".join(message.split()) or type(error).__name__)


def _value_at(config, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return None
        node = node[part]
    return node
