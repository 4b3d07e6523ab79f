"""A tiny name -> function registry, so losses and estimators are picked by name, not by if-chains."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

FnT = TypeVar("FnT", bound=Callable)


class Registry(Generic[FnT]):
    """Maps names to callables; unknown names raise a ValueError that lists what is allowed."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, FnT] = {}

    def register(self, name: str) -> Callable[[FnT], FnT]:
        """Decorator: ``@LOSSES.register("grpo")``. Registering a name twice is a bug, so it raises."""

        def decorator(fn: FnT) -> FnT:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> FnT:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; allowed: {sorted(self._entries)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
