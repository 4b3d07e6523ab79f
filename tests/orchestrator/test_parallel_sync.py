"""The agents' weight syncs at the end of an iteration run at once, and one that fails leaves only its agent
unsynced (JointOrchestrator.sync_all)."""

import threading
import time

import pytest

from .conftest import AGENTS

SYNC_S = 1.0  # long beside the bookkeeping and thread starts around a sync, so that overlap (or not) is plain


class SlowSync:
    """A sync_weights that takes SYNC_S, on whatever thread calls it, and can be told to fail for an agent."""

    def __init__(self, push, fail_for=()):
        self.push, self.fail_for = push, set(fail_for)
        self.threads: dict[str, str] = {}

    def __call__(self, agent, params, version):
        self.threads[agent] = threading.current_thread().name
        time.sleep(SYNC_S)
        if agent in self.fail_for:
            raise RuntimeError(f"link to {agent}'s instances is down")
        self.push(agent, params, version)


def _sync_intervals(orchestrator):
    return {interval.agent: interval for interval in orchestrator.timeline.intervals()
            if interval.kind == "sync" and interval.end - interval.start >= SYNC_S}


@pytest.mark.timeout(240)
def test_the_agents_weights_sync_at_once_on_threads_of_their_own(orchestrator_factory):
    orchestrator, rollout = orchestrator_factory("flexmarl")
    slow = SlowSync(rollout.sync_weights)
    orchestrator.sync_weights = slow
    orchestrator.run_iteration(0)

    assert sorted(slow.threads) == sorted(AGENTS) and len(set(slow.threads.values())) == len(AGENTS)
    intervals = _sync_intervals(orchestrator)
    assert sorted(intervals) == sorted(AGENTS)
    # All three were under way at the same moment: in sequence they would span 3 x SYNC_S.
    assert max(i.start for i in intervals.values()) < min(i.end for i in intervals.values())
    assert orchestrator.versions() == {agent: 1 for agent in AGENTS}
    assert [version for agent, version in rollout.synced if agent == "verifier"] == [0, 1]


@pytest.mark.timeout(240)
def test_a_failed_sync_leaves_its_agent_unsynced_and_the_others_landed(orchestrator_factory):
    orchestrator, rollout = orchestrator_factory("flexmarl")
    orchestrator.sync_weights = SlowSync(rollout.sync_weights, fail_for={"verifier"})
    with pytest.raises(RuntimeError, match="verifier's instances"):
        orchestrator.run_iteration(0)
    landed = {agent: [v for a, v in rollout.synced if a == agent] for agent in AGENTS}
    assert landed == {"solver": [0, 1], "verifier": [0], "corrector": [0, 1]}

    # The link is back: the next sync sends the verifier alone (the others hold their version already).
    orchestrator.sync_weights = SlowSync(rollout.sync_weights)
    orchestrator.sync_all()
    assert [v for a, v in rollout.synced if a == "verifier"] == [0, 1]
    assert len(rollout.synced) == 6
