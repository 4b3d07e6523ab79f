"""Building blocks of the typed config (`schema.py`): a field with its description and rule, the checks that
run when a config is built, and the conversion of a loaded ConfigDict into the dataclasses.

A field's rule is a function of its value that returns None when the value is allowed and otherwise the rule
it breaks ("must be > 0"); `choices` names a registry (a function returning its names). Every failure is one
`ConfigError` line: `config.FIELD=VALUE <rule>`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexmarl_jax.config.errors import ConfigError

Rule = Callable[[Any], str | None]


def setting(default: Any = dataclasses.MISSING, *, help: str, rule: Rule | None = None,
            choices: Callable[[], Sequence[str]] | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A schema field: its default (`factory` for sections and mappings), a one-line description, and
    optionally a rule and the registry its value comes from."""
    metadata = {"help": help, "rule": rule, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def positive(value) -> str | None:
    return None if value > 0 else "must be a positive integer"


def at_least_zero(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def above_zero(value) -> str | None:
    return None if value > 0 else "must be > 0"


def dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ------------------------------------------------------------------------------------ field kinds


def mapping_value_type(kind: Any) -> Any | None:
    """`V` for a field typed `Mapping[str, V]`; None for any other field."""
    if typing.get_origin(kind) is Mapping:
        return typing.get_args(kind)[1]
    return None


def is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def freeze(value: Any) -> Any:
    """A read-only copy: mappings become MappingProxyType, lists tuples, recursively."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """Plain dicts and tuples again (what builders that take keyword arguments expect)."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(thaw(item) for item in value)
    return value


class Section:
    """Base of the schema's frozen dataclasses: ints given for float fields become floats and mappings are
    frozen, so a built config is read-only all the way down."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, field.name, float(value))
            elif mapping_value_type(field.type) is not None and isinstance(value, Mapping):
                object.__setattr__(self, field.name, freeze(value))

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (JSON-ready)."""
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


# ------------------------------------------------------------------------------------ checks


def _check_type(value: Any, kind: Any, where: str) -> None:
    if is_section(kind):
        if not isinstance(value, kind):
            raise ConfigError(f"config.{where} must be a {kind.__name__}, got {value!r}")
        return
    item_kind = mapping_value_type(kind)
    if item_kind is not None:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config.{where} must be a section (ConfigDict), got {value!r}")
        if item_kind is not Any:
            for key, item in value.items():
                _check_type(item, item_kind, f"{where}.{key}")
        return
    if kind is Any:
        return
    if isinstance(value, bool) and kind is not bool or not isinstance(value, (int, float) if kind is float else kind):
        raise ConfigError(f"config.{where}={value!r} has type {type(value).__name__}; expected {kind.__name__}")


def check_section(section: Section, path: str) -> None:
    """Checks every field of `section` (at `path`, "" for the top) and of the sections inside it: its type,
    its registry and its rule, then the section's own cross-field `check`."""
    for field in dataclasses.fields(section):
        value, where = getattr(section, field.name), dotted(path, field.name)
        _check_type(value, field.type, where)
        if is_section(field.type):
            check_section(value, where)
        elif is_section(mapping_value_type(field.type)):
            for key, item in value.items():
                check_section(item, f"{where}.{key}")
        choices, rule = field.metadata["choices"], field.metadata["rule"]
        if choices is not None and value not in (allowed := choices()):
            raise ConfigError(f"config.{where}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
        broken = rule(value) if rule is not None else None
        if broken:
            raise ConfigError(f"config.{where}={value!r} {broken}")
    check = getattr(section, "check", None)
    if check is not None:
        check(path)


# ------------------------------------------------------------------------------------ ConfigDict -> sections


def build_section(cls: type, values: Any, path: str, *, missing_as_default: bool = False):
    """An instance of section `cls` from the plain dict `values` (a ConfigDict's `to_dict()`); a key the
    section lacks is an error, and so is a field the dict lacks unless `missing_as_default`, which leaves it at
    the field's default. Why that option: a run's config.json written before a field existed still reads (for
    export, serving) as the run it describes, on the rule that a new field's default keeps the old behaviour."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"config.{path} must be a section (ConfigDict), got {values!r}")
    fields = dataclasses.fields(cls)
    names = [field.name for field in fields]
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown config key {dotted(path, key)!r}; allowed in {path or 'config'}: "
                              f"{', '.join(sorted(names))}")
    for field in fields:
        if field.name not in values and not (missing_as_default and _has_default(field)):
            raise ConfigError(f"missing config key {dotted(path, field.name)!r}")
    return cls(**{field.name: _build_value(field.type, values[field.name], dotted(path, field.name),
                                           missing_as_default)
                  for field in fields if field.name in values})


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _build_value(kind: Any, value: Any, where: str, missing_as_default: bool) -> Any:
    if is_section(kind):
        return build_section(kind, value, where, missing_as_default=missing_as_default)
    item_kind = mapping_value_type(kind)
    if item_kind is None:
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"config.{where} must be a section (ConfigDict), got {value!r}")
    return {key: _build_value(item_kind, item, f"{where}.{key}", missing_as_default) for key, item in value.items()}


def walk_fields(cls: type, path: str = ""):
    """(dotted name, dataclasses.Field) of every field of `cls` and of the sections inside it; the fields of a
    `Mapping[str, Section]` (the agents) appear under `<path>.*`."""
    for field in dataclasses.fields(cls):
        where = dotted(path, field.name)
        yield where, field
        if is_section(field.type):
            yield from walk_fields(field.type, where)
        elif is_section(mapping_value_type(field.type)):
            yield from walk_fields(mapping_value_type(field.type), f"{where}.*")
