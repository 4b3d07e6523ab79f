"""Where a run resumes: the newest policy version of which every agent has a checkpoint that passes verification.

Two things can leave the newest checkpoints unusable. Agents are saved one after another, so a run killed in
between leaves some agents a version ahead; and any checkpoint may fail verification (`train/checkpoint_integrity`:
bytes changed on disk, or a save killed before its manifest). Either way the run goes back to the newest
version all agents hold intact, reports every version it passed over, and deletes every checkpoint newer than
it, so the iterations after it are redone and every agent resumes from the same version. What the store needs
for that (the rows the discarded updates trained are dropped, not counted as trained) is the journal's
(`RunJournal.settle`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import orbax.checkpoint as ocp

from flexmarl_jax.train.checkpoint import verify_checkpoint
from flexmarl_jax.train.checkpoint_integrity import CheckpointCorrupted
from flexmarl_jax.workdir_paths import orbax_directory

logger = logging.getLogger(__name__)


class NoIntactCheckpoint(CheckpointCorrupted):
    """Checkpoints exist, but no version of them is intact for every agent: nothing to resume from."""


class ResumePoint(NamedTuple):
    version: int  # every agent restores its checkpoint of this version; the run continues at this iteration
    rejected: dict[int, str]  # newer versions passed over -> why (one line naming the agent and the file)


def checkpoint_steps(root: str, agents: Sequence[str]) -> dict[str, set[int]]:
    """agent -> the policy versions it has a finished Orbax step of (empty for an agent with none)."""
    steps = {}
    for agent in agents:
        directory = orbax_directory(root, agent)
        if not directory.is_dir():
            steps[agent] = set()
            continue
        with ocp.CheckpointManager(directory) as manager:
            steps[agent] = set(manager.all_steps())
    return steps


def _delete(root: str, agent: str, versions) -> None:
    with ocp.CheckpointManager(orbax_directory(root, agent)) as manager:
        for step in sorted(versions):
            manager.delete(step)


def _start_over(root: str, steps: dict[str, set[int]], why: str) -> None:
    """Deletes the run's only saved version: its first save (the warm-up's version 0, or the first iteration's
    without a warm-up) is unusable and there is nothing older to fall back to, so the run starts over."""
    logger.warning("%s: deleting it and starting over", why)
    for agent, versions in steps.items():
        if versions:
            _delete(root, agent, versions)


def _problem(root: str, agents: Sequence[str], version: int) -> str | None:
    """Why the checkpoints of `version` cannot be resumed from (the first agent that fails), or None."""
    for agent in agents:
        try:
            verify_checkpoint(orbax_directory(root, agent), version)
        except CheckpointCorrupted as error:
            return f"agent {agent!r}: {error}"
    return None


def prepare_resume(root: str, agents: Sequence[str]) -> ResumePoint | None:
    """The newest version every agent has an intact checkpoint of (None: no checkpoints, a fresh run), after
    deleting every checkpoint newer than it (or, when the run's first save was cut between agents or fails
    verification, that save: None). Raises NoIntactCheckpoint, deleting nothing, when checkpoints exist
    but no version is intact for every agent."""
    steps = checkpoint_steps(root, agents)
    held = set().union(*steps.values())
    if not held:
        return None
    common = sorted(set.intersection(*steps.values()), reverse=True)
    rejected: dict[int, str] = {}
    version = None
    for candidate in common:
        problem = _problem(root, agents, candidate)
        if problem is None:
            version = candidate
            break
        rejected[candidate] = problem
        logger.error("policy version %d cannot be resumed from: %s", candidate, problem)
    if version is None and len(held) == 1:  # only the first save exists: cut between agents, or not intact
        only = min(held)
        _start_over(root, steps, (
            f"the run's only checkpoint version {only} is not intact for every agent ({rejected[only]})" if common
            else f"the first save of policy version {only} was cut between agents "
                 f"({', '.join(a for a, v in steps.items() if v)} have it, "
                 f"{', '.join(a for a, v in steps.items() if not v)} not)"))
        return None
    if not common:  # agents hold different versions: not this run's doing
        raise NoIntactCheckpoint(f"no checkpoint version under {root} is held by every agent: "
                                 + "; ".join(f"{agent} has {sorted(versions) or 'none'}"
                                             for agent, versions in steps.items())
                                 + " (a workdir of another team or config?)")
    if version is None:
        raise NoIntactCheckpoint(f"no checkpoint version under {root} is intact for every agent: "
                                 + "; ".join(f"version {v}: {why}" for v, why in rejected.items()))
    for agent in agents:
        newer = [step for step in steps[agent] if step > version]
        if newer:
            _delete(root, agent, newer)
    if rejected:
        logger.warning("resuming from policy version %d, the newest intact one; passed over %s", version,
                       ", ".join(str(v) for v in sorted(rejected)))
    return ResumePoint(version, rejected)
