"""The joint orchestrator: pipeline modes, dispatch, consistency invariants, agent-centric allocation."""
