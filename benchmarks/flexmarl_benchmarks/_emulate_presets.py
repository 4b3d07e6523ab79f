"""Workload presets of `flexmarl bench emulate`: multi-agent teams sized like the FlexMARL paper's, on emulated
chips (`pipeline.emulate`), and the modes each is run in.

A preset is a team (the agents and the workflow that calls them) plus overrides of configs/tiny.py: every knob
not named here keeps its value and its explanation there. `PAPER_WORKLOAD` holds what both teams share, the
paper's RL setting: batch 64 per agent (4 queries in flight x 16 samples) trained in micro-batches of 16;
long-tailed responses (log-normal around a median, capped at 8192 tokens); 4 engine instances of 64 decode
slots per agent, one chip each (each preset lowers the slots to what fits its chips' memory at the maximum
context, `slots_that_fit`); training meshes of 4 chips. The modes are the paper's: flexmarl is
on-policy (staleness 0) with micro-batch overlap, balancing (queue-gap threshold Delta = 5) and shared
training slices, and each ablation takes one of those away; flexmarl_stale is this project's
bounded-staleness extension (up to 5 versions behind), run beside them and never reported as the paper's.
Load is skewed within each team: some agents are called several times per trajectory (a repeated role shares
one policy), so their engines and trainers carry several times the others' rows.

MA (math-agent team, 15 agents): configs/mixture.py with 14 proposers (calls 4, 3, 2 and eleven of 1) and an
aggregator; Qwen2.5-14B on TPU v5p (one chip per engine instance: 29.5 GB of weights and 39 slots of KV cache
at the maximum context, 65 GB).
CA (coding-agent team, 11 agents): a DAG (configs/dag_example.py's builder): a planner; six coders (calls 3, 2
and four of 1) and three testers (calls 2, 1, 1) working from the plan side by side; a reviewer reading them
all. Qwen2.5-32B on TPU v5p, two chips per engine instance (its 65.5 GB of bf16 weights leave one chip 29 GB,
under 14 sequences' KV cache at the maximum context; two hold 56) and eight per training mesh (fp32 Adam state
of 32B parameters, ~512 GB, needs more than four chips' 380 GB). Three calls deep: plan, write and test,
review.

`bench emulate --set KEY=VALUE` changes any config key for a run (e.g. a shorter `rollout.max_response_length`
for a host that cannot drive the full size); the JSON records the overrides that ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import ml_collections

# Both teams: the paper's RL setting, as overrides of configs/tiny.py.
PAPER_WORKLOAD: dict[str, object] = {
    "workflow.queries_per_iteration": 4,  # queries in flight
    "workflow.samples_per_query": 16,  # the GRPO group: 4 x 16 = a batch of 64 per agent call
    "workflow.warmup_steps": 0,  # no supervised warm-up: scripted tokens carry no content to learn
    "train.micro_batch_size": 16,
    "rollout.max_prompt_length": 256,
    "rollout.max_response_length": 8192,
    "rollout.instances_per_agent": 4,
    "rollout.decode_slots": 64,
    "mesh.rollout_devices_per_instance": 1,
    "mesh.train_devices_per_agent": 4,
    "eval.enabled": False,
    "store.backend": "memory",
    "pipeline.emulate_median_response": 1024,
    "pipeline.emulate_compression": 8.0,
}
# Shared training slices of the flexmarl mode (agent-centric allocation): 8 slices of 4 chips, 32 chips where the
# baselines hold 15 x 4 = 60. Sized to the training demand: with 4 slices a first MA run was training-bound
# (86% busy, E2E 328 device-s against static allocation's 233), the pool the bottleneck, not the pipeline.
FLEXMARL_TRAIN_SLICES = 8
# flexmarl_stale's bound: ours, not the paper's (the paper's Delta = 5 is the balancer's queue-gap threshold,
# `pipeline.balance_delta`, and its system is on-policy). The same number, so the extension has as much room.
STALE_MAX_STALENESS = 5


@dataclasses.dataclass(frozen=True)
class Preset:
    """One emulated team: `team` sets its agents and workflow on a configs/tiny.py ConfigDict; `overrides` (dotted
    config keys) go on top of `PAPER_WORKLOAD`; `iterations` are timed, after one untimed iteration (the first
    has nothing to overlap with)."""

    name: str
    team: Callable[[ml_collections.ConfigDict], None]
    overrides: Mapping[str, object]
    iterations: int = 2

    def config_dict(self, mode_overrides: Mapping[str, object], *, seed: int, workdir: str,
                    changes: Mapping[str, object] | None = None) -> ml_collections.ConfigDict:
        """configs/tiny.py with this team, `PAPER_WORKLOAD`, the preset's overrides, one mode's, then `changes`."""
        from flexmarl_jax.config import apply_overrides
        from flexmarl_jax.configs import tiny

        config = tiny.base_config()
        self.team(config)
        apply_overrides(config, {"seed": seed, "workdir": workdir, "iterations": 1 + self.iterations,
                                 **PAPER_WORKLOAD, **self.overrides, **mode_overrides, **(changes or {})})
        return config

    def modes(self) -> dict[str, dict[str, object]]:
        """Mode -> config overrides. Serial and sync are on-policy with a training mesh per agent (the baselines);
        flexmarl, as the paper defines it, stays on-policy (staleness 0) and adds micro-batch asynchrony,
        balancing (tiny.py's defaults: Delta = 5) and shared training slices; no_async, no_balancing and
        static_allocation each take one of those away. flexmarl_stale adds our bounded staleness on top."""
        flexmarl = {"pipeline.mode": "flexmarl", "train.max_staleness": 0, "pipeline.balance_delta": 5,
                    "mesh.train_slices": FLEXMARL_TRAIN_SLICES}
        return {
            "serial": {"pipeline.mode": "serial"},
            "sync": {"pipeline.mode": "sync"},
            "flexmarl": flexmarl,
            "no_async": {**flexmarl, "pipeline.async_micro_batches": False},
            "no_balancing": {**flexmarl, "pipeline.balancing": False},
            "static_allocation": {**flexmarl, "mesh.train_slices": 0},
            "flexmarl_stale": {**flexmarl, "train.max_staleness": STALE_MAX_STALENESS},
        }


def _agents(config: ml_collections.ConfigDict, names) -> None:
    """`names` as the team's agents (tiny.py's agent settings), each playing the role of its own name."""
    from flexmarl_jax.configs import tiny

    config.agents = ml_collections.ConfigDict()
    config.workflow.roles = ml_collections.ConfigDict()
    for name in names:
        config.agents[name] = tiny.agent_config()
        config.workflow.roles[name] = name


def repeated(calls: Mapping[str, int]) -> tuple[str, ...]:
    """Each agent repeated as many times as it is called per trajectory, in order."""
    return tuple(agent for agent, count in calls.items() for _ in range(count))


def mixture_team(proposer_calls: Mapping[str, int]) -> Callable[[ml_collections.ConfigDict], None]:
    """configs/mixture.py's team with these proposers (each called as often as given) and the aggregator."""

    def team(config: ml_collections.ConfigDict) -> None:
        from flexmarl_jax.configs import mixture

        mixture_config = mixture.base_config()
        config.workflow.name = "mixture"
        config.workflow.options = mixture_config.workflow.options
        config.workflow.shaping_weights = mixture_config.workflow.shaping_weights
        config.workflow.options.proposers = repeated(proposer_calls)
        _agents(config, (*proposer_calls, "aggregator"))

    return team


def coding_team(coder_calls: Mapping[str, int],
                tester_calls: Mapping[str, int]) -> Callable[[ml_collections.ConfigDict], None]:
    """planner -> (every coder call, every tester call) -> reviewer, as a `dag` workflow (workflows/builtin.py);
    a repeated agent's calls are separate nodes with their own turns."""

    def team(config: ml_collections.ConfigDict) -> None:
        workers = [(f"{agent}_{index}", agent) for index, agent in
                   enumerate(repeated(coder_calls) + repeated(tester_calls))]
        nodes = [{"agent": "planner", "turn": 0}]
        nodes += [{"name": name, "agent": agent, "template": "{prompt}{planner}>", "turn": 1 + index}
                  for index, (name, agent) in enumerate(workers)]
        nodes.append({"agent": "reviewer", "template": "{prompt}{inputs}?", "turn": 1 + len(workers)})
        options = ml_collections.ConfigDict()
        options.nodes = tuple(nodes)
        options.edges = tuple([("planner", name) for name, _ in workers]
                              + [(name, "reviewer") for name, _ in workers])
        options.answer_from = ("reviewer",)
        options.max_field_chars = 6  # upstream answers cut to this many characters in the reviewer's prompt
        config.workflow.name = "dag"
        config.workflow.options = options
        config.workflow.shaping_weights = ml_collections.ConfigDict({"own_answer_correct": 0.5})
        _agents(config, ("planner", *coder_calls, *tester_calls, "reviewer"))

    return team


MA_PROPOSER_CALLS = {f"proposer{index}": calls for index, calls in enumerate((4, 3, 2) + (1,) * 11)}
CA_CODER_CALLS = {f"coder{index}": calls for index, calls in enumerate((3, 2, 1, 1, 1, 1))}
CA_TESTER_CALLS = {"tester0": 2, "tester1": 1, "tester2": 1}


def slots_that_fit(emulate: str, chips: int) -> int:
    """Decode slots per engine instance of `chips` chips (`emulate` = CHIP:MODEL) whose KV cache fits beside the
    weights at the workload's maximum context (prompt + response caps), as the run config checks it
    (emulation/cost_model.py `decode_slots_problem`): the source of each preset's `rollout.decode_slots`."""
    from flexmarl_jax.emulation.cost_model import instance_cost_model

    context = PAPER_WORKLOAD["rollout.max_prompt_length"] + PAPER_WORKLOAD["rollout.max_response_length"]
    return instance_cost_model(emulate, chips).decode_slots_that_fit(context)


# 39 slots of 8,448 positions fit beside Qwen2.5-14B's 29.5 GB on a 95 GB v5p chip; 56 beside Qwen2.5-32B's
# 65.5 GB on two.
MA = Preset(name="MA", team=mixture_team(MA_PROPOSER_CALLS),
            overrides={"pipeline.emulate": "v5p:qwen2.5-14b",
                       "rollout.decode_slots": slots_that_fit("v5p:qwen2.5-14b", chips=1)})
CA = Preset(name="CA", team=coding_team(CA_CODER_CALLS, CA_TESTER_CALLS),
            overrides={"pipeline.emulate": "v5p:qwen2.5-32b", "mesh.rollout_devices_per_instance": 2,
                       "mesh.train_devices_per_agent": 8,
                       "rollout.decode_slots": slots_that_fit("v5p:qwen2.5-32b", chips=2)})
PRESETS: dict[str, Preset] = {"MA": MA, "CA": CA}
# The FlexMARL paper's figures for each preset, printed beside ours (a pair is the paper's range): speedup over
# its serial baseline (MAS-RL: 914.4 / 126.1 s for MA, 438.6 / 78.8 s for CA), E2E without async (256.2 / 126.1
# and 124.1 / 78.8, less one), throughput lost without balancing (-20% to -26%, MA and CA together) and its
# utilization (32.4% MA, 19.8% CA).
PAPER = {
    "MA": {"speedup_vs_serial": 7.3, "e2e_increase_without_async": 1.03,
           "throughput_loss_without_balancing": (0.20, 0.26), "train_utilization": 0.324},
    "CA": {"speedup_vs_serial": 5.6, "e2e_increase_without_async": 0.58,
           "throughput_loss_without_balancing": (0.20, 0.26), "train_utilization": 0.198},
}
