"""Workload presets of `flexmarl bench emulate`: multi-agent teams sized like the FlexMARL paper's, on emulated
chips (`pipeline.emulate`), and the modes each is run in.

MA (math-agent team): the mixture workflow (configs/mixture.py) with 14 proposer agents and an aggregator, 15
agents in all. Load is skewed by calls: the first proposers answer several times per trajectory (a repeated
name shares one policy), so their engines and trainers carry several times the others' rows. Responses are
long-tailed (log-normal around `median_response`, capped at `max_response`, 8192 tokens); a batch of 64 per
agent (4 queries in flight x 16 samples) is trained in micro-batches of 16, up to 5 versions stale.
Sizes are the paper's 14B model on TPU v5p: one chip per engine instance, four per training slice.

`scaled(...)` shrinks a preset (shorter responses, fewer agents or instances) for a host that cannot drive the
full size; the JSON records the sizes that ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Preset:
    """One emulated team and its workload (see the module docstring)."""

    name: str
    emulate: str  # CHIP:MODEL
    proposer_calls: tuple[int, ...]  # calls per trajectory of each proposer agent (the skew)
    queries: int = 4  # queries per iteration (in flight together)
    samples: int = 16  # samples per query (the GRPO group)
    micro_batch: int = 16
    max_staleness: int = 5
    max_response: int = 8192
    median_response: int = 1024
    max_prompt: int = 256
    instances_per_agent: int = 4
    decode_slots: int = 64
    rollout_chips: int = 1  # chips per engine instance
    train_chips: int = 4  # chips per training slice (or per agent's dedicated mesh)
    train_slices: int = 4  # shared training slices of the flexmarl mode (agent-centric allocation)
    compression: float = 8.0
    iterations: int = 2  # timed, after one untimed iteration (the first has nothing to overlap with)

    @property
    def agents(self) -> int:
        return len(self.proposer_calls) + 1

    def scaled(self, **changes) -> Preset:
        return dataclasses.replace(self, **changes)

    def proposers(self) -> tuple[str, ...]:
        """Proposer roles in the mixture's order: agent i repeated `proposer_calls[i]` times."""
        return tuple(f"proposer{i}" for i, calls in enumerate(self.proposer_calls) for _ in range(calls))

    def config_dict(self, mode_overrides: Mapping[str, object], *, seed: int, workdir: str):
        """The run's ConfigDict: configs/mixture.py's team at this preset's sizes, then one mode's overrides."""
        import ml_collections

        from flexmarl_jax.configs import mixture, tiny

        config = mixture.base_config()
        config.seed, config.workdir = seed, workdir
        config.iterations = 1 + self.iterations
        agents = sorted(set(self.proposers()), key=lambda name: int(name.removeprefix("proposer")))
        config.agents = ml_collections.ConfigDict()
        config.workflow.roles = ml_collections.ConfigDict()
        for name in (*agents, "aggregator"):
            config.agents[name] = tiny.agent_config()
            config.workflow.roles[name] = name
        config.workflow.options.proposers = self.proposers()
        config.workflow.queries_per_iteration = self.queries
        config.workflow.samples_per_query = self.samples
        config.workflow.warmup_steps = 0
        config.eval.enabled = False
        config.train.micro_batch_size = self.micro_batch
        config.rollout.max_prompt_length = self.max_prompt
        config.rollout.max_response_length = self.max_response
        config.rollout.instances_per_agent = self.instances_per_agent
        config.rollout.decode_slots = self.decode_slots
        config.mesh.rollout_devices_per_instance = self.rollout_chips
        config.mesh.train_devices_per_agent = self.train_chips
        config.store.backend = "memory"
        pipeline = config.pipeline
        pipeline.emulate = self.emulate
        pipeline.emulate_compression = self.compression
        pipeline.emulate_median_response = self.median_response
        for dotted, value in mode_overrides.items():
            *sections, leaf = dotted.split(".")
            node = config
            for section in sections:
                node = node[section]
            node[leaf] = value
        return config

    def modes(self) -> dict[str, dict[str, object]]:
        """Mode -> config overrides. Serial and sync are on-policy with a training mesh per agent (the baselines);
        flexmarl adds micro-batch asynchrony, balancing, staleness and `train_slices` shared slices; each
        ablation takes one of those away."""
        flexmarl = {"pipeline.mode": "flexmarl", "train.max_staleness": self.max_staleness,
                    "mesh.train_slices": self.train_slices}
        return {
            "serial": {"pipeline.mode": "serial"},
            "sync": {"pipeline.mode": "sync"},
            "flexmarl": flexmarl,
            "no_async": {**flexmarl, "pipeline.async_micro_batches": False},
            "no_balancing": {**flexmarl, "pipeline.balancing": False},
            "static_allocation": {**flexmarl, "mesh.train_slices": 0},
        }


# The proposers' calls per trajectory: three agents carry 4, 3 and 2 calls, eleven carry one (17 proposer calls).
MA = Preset(name="MA", emulate="v5p:qwen2.5-14b", proposer_calls=(4, 3, 2) + (1,) * 11)
PRESETS: dict[str, Preset] = {"MA": MA}
# The FlexMARL paper's figures for each preset, printed beside ours.
PAPER = {"MA": {"speedup_vs_serial": 7.3, "e2e_increase_without_async": 1.03,
                "throughput_loss_without_balancing": (0.20, 0.26), "train_utilization": 0.5}}
