"""Fault injection points: named places where a test or `flexmarl bench faults` makes the system fail on purpose.

Off unless armed, and then nothing but a check of an empty dict at each point (`fire` returns at once when
nothing is armed). A test arms a fault in-process (`arm("trainer_error", after=1)`); a `flexmarl train`
subprocess arms them from the environment, `FLEXMARL_FAULTS="instance_hang:after=3,trainer_error"`
(`arm_from_env`, called once by `run_training`). An unknown name is an error listing the known ones.

Each point calls `fire(name, where)`; it returns True when the fault triggers there now (the point then
misbehaves in its own way: raise, hang, slow down). `after=n` lets the first n hits pass, `times=k` triggers k
times (0: every hit from then on), and `where` restricts the fault to one target (an instance's name, an
agent's name).

Detection points: where the system notices a failure (an instance taken out of routing, a request timed out, an
iteration retried, a run stopping) it calls `detected(what)`; while a fault is armed the time is kept, so
`flexmarl bench faults` measures from `fired_at(name)` to the first detection after it. Off, it is the same
empty-dict check.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

FAULTS: dict[str, str] = {
    "instance_crash": "a rollout instance raises in an engine step",
    "instance_hang": "a rollout instance's engine step never returns (the instance stops making progress)",
    "instance_slow": "a rollout instance's engine steps take 10x longer",
    "trainer_error": "a trainer raises in the middle of a micro-batch",
    "store_commit": "the experience store fails a commit",
    "checkpoint_save": "an Orbax checkpoint save fails",
    "weight_sync": "a weight sync to the rollout instances fails",
}
ENV_VAR = "FLEXMARL_FAULTS"
SLOWDOWN = 10.0  # instance_slow: a step takes this many times its own duration


class InjectedFault(RuntimeError):
    """The error an armed fault raises."""


@dataclasses.dataclass
class _Armed:
    after: int = 0  # hits that pass before it triggers
    times: int = 1  # triggers left (0: unlimited)
    where: str | None = None  # only at this target (None: anywhere)
    hits: int = 0
    hits_at: dict = dataclasses.field(default_factory=dict)  # target -> hits there (`where` of each hit)
    fired: int = 0
    fired_at: float | None = None  # time.time() of the first trigger


_armed: dict[str, _Armed] = {}
_detections: list[tuple[float, str]] = []  # (time.time(), what) of each detection while something is armed
_lock = threading.Lock()
hang_release = threading.Event()  # instance_hang blocks until this is set (`disarm` sets it)


def check_name(name: str) -> str:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    return name


def arm(name: str, *, after: int = 0, times: int = 1, where: str | None = None) -> None:
    """Arms `name` (see the module docstring); re-arming replaces the earlier setting."""
    check_name(name)
    if after < 0 or times < 0:
        raise ValueError(f"fault {name!r}: after={after} and times={times} must be >= 0")
    with _lock:
        hang_release.clear()
        _armed[name] = _Armed(after=after, times=times, where=where)


def disarm(name: str | None = None) -> None:
    """Disarms one fault, or all; releases hung steps."""
    with _lock:
        if name is None:
            _armed.clear()
            _detections.clear()
        else:
            _armed.pop(check_name(name), None)
        hang_release.set()


def fired(name: str) -> int:
    """How often `name` triggered since it was armed."""
    with _lock:
        armed = _armed.get(check_name(name))
        return 0 if armed is None else armed.fired


def hits(name: str, where: str | None = None) -> int:
    """How often the point `name` was reached (at its target; with `where`, at that target) since it was armed,
    triggering or not."""
    with _lock:
        armed = _armed.get(check_name(name))
        if armed is None:
            return 0
        return armed.hits if where is None else armed.hits_at.get(where, 0)


def hit_targets(name: str) -> dict[str, int]:
    """target -> how often the point `name` was reached there since it was armed (targets named by the point)."""
    with _lock:
        armed = _armed.get(check_name(name))
        return {} if armed is None else {where: n for where, n in armed.hits_at.items() if where is not None}


def fired_at(name: str) -> float | None:
    """The time (`time.time()`) `name` first triggered since it was armed; None if it has not."""
    with _lock:
        armed = _armed.get(check_name(name))
        return None if armed is None else armed.fired_at


def detected(what: str) -> None:
    """Called where the system notices a failure; kept (with the time) only while some fault is armed."""
    if not _armed:  # the cost when nothing is armed
        return
    with _lock:
        _detections.append((time.time(), what))


def detections() -> list[tuple[float, str]]:
    """Every (time.time(), what) passed to `detected` since the faults were last all disarmed, oldest first."""
    with _lock:
        return list(_detections)


def fire(name: str, where: str | None = None) -> bool:
    """Called at the injection point `name` (at target `where`): True when the fault triggers now."""
    if not _armed:  # the cost when nothing is armed
        return False
    with _lock:
        armed = _armed.get(name)
        if armed is None or armed.where is not None and armed.where != where:
            return False
        armed.hits += 1
        armed.hits_at[where] = armed.hits_at.get(where, 0) + 1
        if armed.hits <= armed.after or armed.times and armed.fired >= armed.times:
            return False
        armed.fired += 1
        if armed.fired_at is None:
            armed.fired_at = time.time()
        return True


def raise_if_fired(name: str, where: str | None = None) -> None:
    """The common point: raise InjectedFault when `name` triggers."""
    if fire(name, where):
        raise InjectedFault(f"injected fault {name}" + (f" at {where}" if where else "") + f": {FAULTS[name]}")


def parse(spec: str) -> dict[str, dict]:
    """`"name[:key=value[:key=value]],..."` -> {name: {after, times, where}}; ValueError naming bad parts."""
    plans = {}
    for part in filter(None, (piece.strip() for piece in spec.split(","))):
        name, *options = part.split(":")
        check_name(name)
        settings: dict = {}
        for option in options:
            key, _, value = option.partition("=")
            if key in ("after", "times"):
                settings[key] = int(value)
            elif key == "where":
                settings[key] = value
            else:
                raise ValueError(f"fault {name!r}: unknown option {key!r}; options: after, times, where")
        plans[name] = settings
    return plans


def arm_from_env(environ=os.environ) -> list[str]:
    """Arms what `FLEXMARL_FAULTS` names (nothing when unset); returns the names armed."""
    plans = parse(environ.get(ENV_VAR, ""))
    for name, settings in plans.items():
        arm(name, **settings)
    return list(plans)
