"""The typed run config: one frozen dataclass per section, built once from a loaded ConfigDict.

    config = RunConfig.from_config(load_config("configs/debate.py:judge"))

`RunConfig.from_config` rejects keys the schema lacks and fields the ConfigDict lacks; constructing a
`RunConfig` (also through `dataclasses.replace`) checks every field against the rule and registry next to it
(`fields.setting`) and then the rules that span sections (`RunConfig.check`), raising one-line `ConfigError`s.
Allowed names come from the registries (workflows, tasks, pipeline modes, store backends, algorithms), all
importable without JAX. Free-form sections (`agents`, `workflow.options`, `roles`, `task_options`,
`shaping_weights`) are read-only mappings; the workflow's registry entry checks them (`workflow_checks.py`).

This module does not use `from __future__ import annotations`: the field types are read at run time.
"""

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.fields import (
    Section,
    above_zero,
    at_least_zero,
    build_section,
    check_section,
    positive,
    setting,
)
from flexmarl_jax.config.lora_groups import lora_base_groups
from flexmarl_jax.config.modes import PIPELINE_MODES
from flexmarl_jax.config.process_rules import check_per_process
from flexmarl_jax.config.rules import (
    algorithm_names,
    coordinator_address_rule,
    emulate_compression_rule,
    emulate_link_rule,
    emulate_mfu_rule,
    emulate_rule,
    emulate_tokens_per_call_rule,
    model_rule,
    regex_rule,
    store_backends,
    task_rule,
    warmup_kinds,
    workdir_rule,
    workflow_names,
)
from flexmarl_jax.models.dtypes import PARAM_DTYPES, master_weights_problem
from flexmarl_jax.models.lora_rules import lora_alpha_problem, lora_rank_problem
from flexmarl_jax.models.lora_targets import ALL as ALL_TARGETS
from flexmarl_jax.models.lora_targets import TARGETS, parse_targets, targets_problem
from flexmarl_jax.rollout.routing_rules import (
    balance_cooldown_problem,
    balance_delta_problem,
    balance_poll_problem,
    instances_to_keep_problem,
    max_retries_problem,
    min_instances_problem,
)
from flexmarl_jax.train.rules import (
    rows_per_pass_problem,
    temperature_problem,
    tis_cap_problem,
    top_k_problem,
    top_p_problem,
)

_frozen = dataclasses.dataclass(frozen=True)


# ------------------------------------------------------------------------------------ sections


@_frozen
class LoraConfig(Section):
    """An agent's LoRA adapter (`config.agents.<name>.lora`): with rank > 0 the agent trains an adapter on a
    frozen copy of its `model`, which agents of the same model share (models/lora.py)."""

    rank: int = setting(0, rule=lora_rank_problem, help="the adapter's rank; 0 = full fine-tuning (no adapter)")
    alpha: float = setting(16.0, rule=lora_alpha_problem, help="the adapter's update is scaled by alpha / rank")
    targets: str = setting(ALL_TARGETS, rule=targets_problem,
                           help=f"the projections that carry an adapter, comma-separated among "
                                f"{', '.join(TARGETS)}; {ALL_TARGETS!r} = the seven")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_names(self) -> tuple[str, ...]:
        return parse_targets(self.targets)


@_frozen
class AgentConfig(Section):
    """One agent (`config.agents.<name>`): its model and how rollouts sample from it."""

    model: str = setting("tiny", rule=model_rule,
                         help="model preset name (flexmarl_jax.models.presets) or a local HF checkpoint dir")
    temperature: float = setting(1.0, rule=temperature_problem, help="sampling temperature used for rollouts")
    top_k: int = setting(0, rule=top_k_problem, help="keep the k most likely tokens; 0 = no top-k filter")
    top_p: float = setting(1.0, rule=top_p_problem, help="nucleus sampling mass in (0, 1]")
    learning_rate: float = setting(
        -1.0, help="this agent's learning rate; -1 = use train.learning_rate",
        rule=lambda lr: None if lr == -1.0 or lr > 0 else "must be > 0 or -1 (use train.learning_rate)")
    dtype: str = setting("float32", choices=lambda: PARAM_DTYPES, help="dtype of this agent's parameters and compute, "
                         "in training and rollout (the KV cache follows it)")
    fp32_master_weights: bool = setting(False, help="bfloat16 only: the optimizer updates a float32 copy of the "
                                        "parameters and the bfloat16 ones are its cast")
    decode_slots: int = setting(0, rule=at_least_zero, help="concurrent sequences per engine instance of this "
                                "agent; 0 = rollout.decode_slots")
    stop_pattern: str = setting("", rule=regex_rule, help="a Python regex: a response ends (finish reason 'stop') "
                                "as soon as its last 64 tokens hold a match, e.g. the line that states the answer; "
                                "'' = none")
    lora: LoraConfig = setting(factory=LoraConfig, help="train a LoRA adapter on a frozen base instead of the "
                               "whole model")

    def check(self, path: str) -> None:
        problem = master_weights_problem(self.dtype, self.fp32_master_weights, where=f"{path}.")
        if problem:
            raise ConfigError(f"config.{path}.{problem}")


def _chain_agents() -> dict[str, AgentConfig]:
    return {name: AgentConfig() for name in ("solver", "verifier", "corrector")}


@_frozen
class WorkflowConfig(Section):
    """The team's workflow and its task (`config.workflow`; see flexmarl_jax/config/workflow_from_config.py)."""

    name: str = setting("chain", choices=workflow_names, help="a registered workflow (workflows/builtin.py)")
    options: Mapping[str, Any] = setting(factory=dict, help="the workflow builder's own arguments; role "
                                         "arguments hold role names; empty = the builder's defaults")
    roles: Mapping[str, str] = setting(factory=dict, help="role -> agent that plays it; a role not listed is "
                                       "played by the agent of its name")
    task: str = setting("reverse", rule=task_rule, help="a registered task or a path to a .jsonl file")
    task_options: Mapping[str, Mapping[str, Any]] = setting(
        factory=dict, help="task -> its constructor arguments; only the selected task's section is read")
    shaping_weights: Mapping[str, float] = setting(
        factory=dict, help="per-agent reward shaping term -> weight; terms not listed keep the workflow default")
    queries_per_iteration: int = setting(16, rule=positive, help="distinct queries rolled out per iteration")
    samples_per_query: int = setting(8, rule=positive, help="trajectories per query (the GRPO group size)")
    warmup_steps: int = setting(150, rule=at_least_zero,
                                help="supervised warm-up steps before the first RL iteration (0 = none)")
    warmup_learning_rate: float = setting(3e-3, rule=above_zero, help="the supervised warm-up's learning rate "
                                          "(its own fresh optimizer; RL then starts a fresh one at the agent's)")
    warmup: str = setting("sft", choices=warmup_kinds, help="what the warm-up teaches, on training problems "
                          "only: format (answers drawn independently of the truth) or sft (right answers)")


@_frozen
class EvalConfig(Section):
    """Held-out evaluation (`config.eval`; docs/workflows.md). The task's problems split into train and eval by
    content; the team runs the eval problems greedily and sampled at the start of RL, every `every`
    iterations and at the end, with nothing of it stored or trained."""

    enabled: bool = setting(True, help="hold out eval problems and evaluate; False = train on every problem, "
                            "never evaluate")
    every: int = setting(20, rule=lambda every: None if every >= 1 else "must be >= 1 (iterations between evals)",
                         help="evaluate after every this many iterations (and at the start and the end)")
    problems: int = setting(200, rule=positive, help="distinct eval problems (fewer when the eval split has fewer)")
    samples: int = setting(8, rule=at_least_zero, help="sampled trajectories per eval problem: the k of "
                           "eval_pass_at_k; 0 = greedy only (no eval_pass_at_k)")
    fraction: float = setting(0.2, rule=lambda share: None if 0 <= share < 1 else "must be in [0, 1)",
                              help="share of the task's problem contents held out for eval (by a hash of each "
                              "prompt); unused with eval.file")
    file: str = setting("", help="a .jsonl task's eval problems from this JSONL file instead of eval.fraction of "
                        "its own; training drops its lines that are also in this file")


@_frozen
class RolloutConfig(Section):
    """Engine instances and request handling (`config.rollout`)."""

    instances_per_agent: int = setting(1, rule=positive, help="engine instances serving each agent")
    decode_slots: int = setting(32, rule=positive, help="concurrent sequences per engine instance")
    max_prompt_length: int = setting(32, rule=positive, help="prompt tokens; longer prompts are an error")
    max_response_length: int = setting(8, rule=positive, help="max new tokens per call")
    min_instances_per_agent: int = setting(1, rule=min_instances_problem,
                                           help="balancing never leaves an agent with fewer instances")
    request_timeout_s: float = setting(0.0, rule=at_least_zero,
                                       help="cancel and re-queue a request running longer; 0 = no timeout")
    max_retries: int = setting(2, rule=max_retries_problem,
                               help="re-queues of a timed-out request before it is reported failed")
    instance_stall_s: float = setting(120.0, rule=above_zero,
                                      help="an instance holding requests that finishes no engine step for this long "
                                      "is taken out of routing and its requests go to the agent's other instances")

    def check(self, path: str) -> None:
        problem = instances_to_keep_problem(self.min_instances_per_agent, self.instances_per_agent,
                                            where=f"{path}.")
        if problem:
            raise ConfigError(f"config.{path}.{problem}")


@_frozen
class TrainConfig(Section):
    """The policy update (`config.train`). The global batch, queries x samples per query, is
    `RunConfig.global_batch_size`."""

    algorithm: str = setting("grpo", choices=algorithm_names, help="RL algorithm (train/algorithms.py)")
    learning_rate: float = setting(3e-4, rule=above_zero, help="default optimizer learning rate of every agent")
    micro_batch_size: int = setting(32, rule=positive, help="samples per gradient micro-batch; divides the "
                                    "global batch and is a multiple of workflow.samples_per_query")
    max_staleness: int = setting(0, rule=at_least_zero,
                                 help="0 = strict on-policy; k > 0 lets rollout run k versions ahead")
    tis_cap: float = setting(2.0, rule=tis_cap_problem,
                             help="max_staleness > 0: cap of the truncated importance weight pi_old / "
                             "pi_behaviour of each trained token")
    remat: bool = setting(False, help="rematerialise each decoder layer in the training step: activation "
                          "memory of one layer instead of all, for about one more forward pass")
    rows_per_pass: int = setting(0, rule=at_least_zero,
                                 help="rows of one forward+backward pass; a micro-batch is trained in passes of this "
                                 "many rows (peak activations follow it); 0 = the whole micro-batch")
    pack_rows: bool = setting(False, help="pack each micro-batch's sequences end to end into as few rows as hold "
                              "them (train/packing.py): same loss and gradients, no compute on a long-tailed "
                              "batch's padding")
    kl_coef: float = setting(0.0, rule=at_least_zero,
                             help="weight of the k3 KL to a frozen copy of each agent's initial policy in the loss; "
                             "0 = none, > 0 keeps that copy in every trainer's memory")
    skip_rows_without_signal: bool = setting(True, help="leave out of the training step the rows whose advantage is "
                                             "0 throughout, where their gradient is exactly 0 (GRPO without KL or "
                                             "truncated IS; train/rows_without_signal.py): same update, less compute")


@_frozen
class MeshConfig(Section):
    """Devices (`config.mesh`)."""

    fake_cpu_devices: int = setting(8, rule=positive,
                                    help="on a CPU host, fake this many XLA devices (ignored on TPU/GPU)")
    rollout_devices_per_instance: int = setting(1, rule=positive, help="devices under each engine instance")
    train_devices_per_agent: int = setting(1, rule=positive,
                                           help="devices in each agent's training mesh (fsdp x tp)")
    tp: int = setting(1, rule=positive, help="tensor-parallel degree inside a training mesh")
    train_slices: int = setting(0, help="training slices shared by all agents; 0 = a dedicated slice per agent")
    colocate: bool = setting(False, help="agents' rollout and training share devices (one GPU, a CPU with one "
                             "device): each agent's engines run on its training devices, agents reuse devices")

    def check(self, path: str) -> None:
        if self.colocate and self.train_slices:
            raise ConfigError(f"config.{path}.colocate=True puts each agent's training on its own (shared) devices; "
                              f"it cannot be combined with {path}.train_slices={self.train_slices}")
        if self.train_devices_per_agent % self.tp:
            raise ConfigError(f"config.{path}.tp={self.tp} must divide "
                              f"{path}.train_devices_per_agent={self.train_devices_per_agent}")


@_frozen
class StoreConfig(Section):
    """The experience store (`config.store`); it lives under the workdir."""

    backend: str = setting("memory", choices=store_backends, help="where the tables live: memory (TensorStore's "
                           "memory driver) or file (OCDBT in WORKDIR/store)")


@_frozen
class PipelineConfig(Section):
    """How rollout and training overlap (`config.pipeline`)."""

    mode: str = setting("flexmarl", choices=lambda: PIPELINE_MODES,
                        help="pipeline mode (config/modes.py, docs/architecture.md)")
    async_micro_batches: bool = setting(True, help="flexmarl only: train micro-batches while rollout runs")
    balancing: bool = setting(True, help="flexmarl only: hierarchical load balancing across instances")
    balance_delta: int = setting(5, rule=balance_delta_problem,
                                 help="move instances when max - min agent queue length exceeds this")
    balance_cooldown_s: float = setting(1.0, rule=balance_cooldown_problem,
                                        help="a moved instance stays with its new agent at least this long "
                                             "(device seconds: an emulated run compresses it)")
    balance_poll_s: float = setting(0.02, rule=balance_poll_problem,
                                    help="how often the balancer polls queue lengths (device seconds, as the "
                                         "cooldown)")
    debug_invariants: bool = setting(False, help="check consistency invariants at run time (slower)")
    deterministic: bool = setting(False, help="train after each rollout, cutting micro-batches in group-id order, "
                                  "so two runs with one seed end with bit-identical parameters (no overlap of "
                                  "training with rollout)")
    emulate: str = setting("", rule=emulate_rule,
                           help="CHIP:MODEL (e.g. v5p:qwen2.5-14b): emulated devices; every engine step, training "
                           "micro-batch, apply and weight sync takes the cost model's time (emulation/); \"\" = off")
    emulate_compression: float = setting(1.0, rule=emulate_compression_rule,
                                         help="emulate: device seconds per wall second")
    emulate_mfu: float = setting(0.4, rule=emulate_mfu_rule,
                                 help="emulate: model-FLOPs utilisation of an emulated training step")
    emulate_median_response: int = setting(0, rule=at_least_zero,
                                           help="emulate: median scripted response tokens, long-tailed up to "
                                           "rollout.max_response_length; 0 = every response that long")
    emulate_sync_link: str = setting("dcn100", rule=emulate_link_rule,
                                     help="emulate: the link a weight sync crosses (one per chip, in parallel)")
    emulate_tokens_per_call: int = setting(64, rule=emulate_tokens_per_call_rule,
                                           help="emulate: decode steps an emulated engine advances per call at most "
                                           "(charged as that many single steps; 1 = one per call, like a real "
                                           "engine); fewer host calls per token keep the host's overhead hidden")


STOP_MODES = ("finish", "abandon")  # what SIGTERM/SIGINT do with the running iteration


def _stop_modes() -> tuple[str, ...]:
    return STOP_MODES


@_frozen
class RunControlConfig(Section):
    """How a run guards against hangs and stops (`config.run`)."""

    stall_timeout_s: float = setting(600.0, rule=above_zero,
                                     help="when no iteration, micro-batch or decode step made progress for this long, "
                                     "the run logs every thread's stack, marks its journal and exits non-zero")
    stop_mode: str = setting("finish", choices=_stop_modes, help="on SIGTERM/SIGINT: finish the running iteration "
                             "(and checkpoint it) or abandon it (resume redoes it); a second signal abandons")
    stop_timeout_s: float = setting(300.0, rule=above_zero,
                                    help="a stop asked for by a signal ends the process within this many seconds")


@_frozen
class DistributedConfig(Section):
    """Several processes, one per host, joined by JAX's distributed runtime (`config.distributed`;
    flexmarl_jax/distributed/). The defaults mean one process."""

    enabled: bool = setting(False, help="join the other processes with jax.distributed.initialize before "
                            "anything runs; False = a single process")
    coordinator_address: str = setting("", rule=coordinator_address_rule,
                                       help="HOST:PORT of process 0's coordinator service; \"\" = auto-detected "
                                       "(Cloud TPU, SLURM, ...)")
    num_processes: int = setting(0, rule=at_least_zero, help="processes in the run; 0 = auto-detected")
    process_id: int = setting(-1, rule=lambda i: None if i >= -1 else "must be >= 0, or -1 to auto-detect it",
                              help="this process's index in 0..num_processes-1; -1 = auto-detected")
    init_timeout_s: float = setting(300.0, rule=above_zero,
                                    help="the coordinator must answer, and every process join, within this many "
                                    "seconds, else the run stops with an error naming what is missing")
    heartbeat_timeout_s: float = setting(30.0, rule=above_zero,
                                         help="a process that misses heartbeats this long counts as lost: the "
                                         "others stop (JAX's runtime default is 100 s)")

    def check(self, path: str) -> None:
        explicit = (self.coordinator_address != "", self.num_processes > 0, self.process_id >= 0)
        if any(explicit) and not all(explicit):
            raise ConfigError(f"config.{path}: coordinator_address={self.coordinator_address!r}, "
                              f"num_processes={self.num_processes} and process_id={self.process_id} are set "
                              "together (all three) or left to auto-detection (\"\", 0, -1)")
        if all(explicit) and self.process_id >= self.num_processes:
            raise ConfigError(f"config.{path}.process_id={self.process_id} must be below "
                              f"{path}.num_processes={self.num_processes}")
        if any(explicit) and not self.enabled:
            raise ConfigError(f"config.{path}.coordinator_address={self.coordinator_address!r} is set but "
                              f"{path}.enabled=False; set {path}.enabled=True to run several processes")


@_frozen
class RunConfig(Section):
    """A whole run. Built from a ConfigDict by `from_config`; every construction checks every rule."""

    seed: int = setting(0, help="one seed drives task generation, parameter init, sampling and shuffling")
    workdir: str = setting("runs/tiny", rule=workdir_rule,
                           help="metrics.jsonl, plots, checkpoints and the store live here: a path, file:///ABS/PATH "
                           "or gs://bucket/path (flexmarl_jax/workdir_paths.py); a file:// URL becomes its path")
    iterations: int = setting(120, rule=positive, help="RL iterations (one policy update per agent each)")
    agents: Mapping[str, AgentConfig] = setting(factory=_chain_agents, help="agent name -> its settings")
    workflow: WorkflowConfig = setting(factory=WorkflowConfig, help="the workflow, its roles and its task")
    rollout: RolloutConfig = setting(factory=RolloutConfig, help="engine instances and request handling")
    train: TrainConfig = setting(factory=TrainConfig, help="the policy update")
    mesh: MeshConfig = setting(factory=MeshConfig, help="devices")
    store: StoreConfig = setting(factory=StoreConfig, help="the experience store")
    pipeline: PipelineConfig = setting(factory=PipelineConfig, help="how rollout and training overlap")
    eval: EvalConfig = setting(factory=EvalConfig, help="held-out evaluation")
    run: RunControlConfig = setting(factory=RunControlConfig, help="hang detection and stopping")
    distributed: DistributedConfig = setting(factory=DistributedConfig,
                                             help="several processes (hosts) in one run; default one process")

    def __post_init__(self) -> None:
        super().__post_init__()
        # lazy: workdir_paths loads etils.epath (40 ms), which `flexmarl --help` (~0.1 s) needs not
        from flexmarl_jax.workdir_paths import BadLocation, normalize

        try:  # everything below sees a plain local path or a remote URL (epath does not take file://)
            object.__setattr__(self, "workdir", normalize(self.workdir))
        except BadLocation as error:
            raise ConfigError(f"config.workdir={self.workdir!r}: {error}") from None
        check_section(self, "")

    @classmethod
    def from_config(cls, config, *, missing_as_default: bool = False) -> "RunConfig":
        """The typed config of a loaded ConfigDict (or a plain nested dict); raises ConfigError. A key the
        config lacks is an error, or with `missing_as_default` (a saved run's config.json) its default."""
        values = config.to_dict() if hasattr(config, "to_dict") else config
        return build_section(cls, values, "", missing_as_default=missing_as_default)

    @property
    def global_batch_size(self) -> int:
        """Samples per agent per iteration: workflow.queries_per_iteration x workflow.samples_per_query."""
        return self.workflow.queries_per_iteration * self.workflow.samples_per_query

    def check(self, path: str) -> None:
        """The rules that span sections (after every field passed its own)."""
        # lazy: the workflow registries (workflows/, jinja2) cost 72 ms; `flexmarl --help` (~0.1 s) needs none
        from flexmarl_jax.config.workflow_checks import check_eval_split, check_workflow

        if not self.agents:
            raise ConfigError("config.agents is empty; declare at least one agent")
        check_workflow(self.workflow, tuple(self.agents))
        check_eval_split(self.eval, self.workflow)
        train, samples = self.train, self.global_batch_size
        if samples % train.micro_batch_size:
            raise ConfigError(f"config.train.micro_batch_size={train.micro_batch_size} must divide "
                              f"train.global_batch_size={samples} (workflow.queries_per_iteration x "
                              "workflow.samples_per_query)")
        problem = rows_per_pass_problem(train.rows_per_pass, train.micro_batch_size, where="train.")
        if problem:
            raise ConfigError(f"config.train.{problem}")
        if train.micro_batch_size % self.workflow.samples_per_query:
            raise ConfigError(f"config.train.micro_batch_size={train.micro_batch_size} must be a multiple of the "
                              f"GRPO group size workflow.samples_per_query={self.workflow.samples_per_query}")
        if self.pipeline.deterministic and train.max_staleness:
            raise ConfigError(f"config.pipeline.deterministic=True needs train.max_staleness=0, got "
                              f"{train.max_staleness}: a rollout that overlaps training samples on whichever weights "
                              "have reached it by then")
        if self.rollout.instance_stall_s >= self.run.stall_timeout_s:
            raise ConfigError(f"config.rollout.instance_stall_s={self.rollout.instance_stall_s:g} must be below "
                              f"run.stall_timeout_s={self.run.stall_timeout_s:g}: a stuck instance must be taken out "
                              "of routing before the whole run counts as stalled")
        if self.pipeline.emulate_median_response > self.rollout.max_response_length:
            raise ConfigError(f"config.pipeline.emulate_median_response={self.pipeline.emulate_median_response} "
                              f"exceeds rollout.max_response_length={self.rollout.max_response_length}")
        self._check_distributed()
        self._check_lora_groups()
        self._check_emulated_slots()
        if not 0 <= self.mesh.train_slices <= len(self.agents):
            raise ConfigError(f"config.mesh.train_slices={self.mesh.train_slices} must be in 0..{len(self.agents)} "
                              "(the number of agents; 0 = a dedicated training slice per agent)")

    def _check_emulated_slots(self) -> None:
        """An emulated engine instance's decode slots must fit its chips' HBM at the maximum context."""
        if not self.pipeline.emulate:
            return
        # lazy: importing the config must not load the emulation package
        from flexmarl_jax.emulation.cost_model import decode_slots_problem

        rollout = self.rollout
        problem = decode_slots_problem(self.pipeline.emulate, rollout.decode_slots,
                                       rollout.max_prompt_length + rollout.max_response_length,
                                       self.mesh.rollout_devices_per_instance)
        if problem:
            raise ConfigError(f"config.rollout.decode_slots={rollout.decode_slots} {problem}")

    def _check_lora_groups(self) -> None:
        """LoRA agents of one `model` share one frozen base (a base group), so they must agree on its dtype; and
        a group's engines serve it within one process."""
        for name, group in lora_base_groups(self).items():
            leader = self.agents[group[0]]
            if self.agents[name].dtype != leader.dtype:
                raise ConfigError(f"config.agents.{name}.dtype={self.agents[name].dtype!r} differs from agents."
                                  f"{group[0]}.dtype={leader.dtype!r}: LoRA agents of model {leader.model!r} share "
                                  "one frozen base, in one dtype")
            if self.distributed.enabled:
                raise ConfigError(f"config.agents.{name}.lora.rank={self.agents[name].lora.rank} with "
                                  "distributed.enabled=True: a LoRA base group's engines serve it within one process; "
                                  "train full models (lora.rank=0) across processes")

    def _check_distributed(self) -> None:
        """Several processes replay one deterministic rollout each, on their own instances of every agent, and
        meet in the training meshes (docs/architecture.md, "Several hosts")."""
        distributed = self.distributed
        if not distributed.enabled:
            return
        if not self.pipeline.deterministic:
            raise ConfigError("config.distributed.enabled=True needs pipeline.deterministic=True: every process "
                              "rolls out the same queries and must cut the same micro-batches")
        if self.pipeline.mode == "serial" or self.mesh.colocate or self.pipeline.emulate:
            raise ConfigError(f"config.distributed.enabled=True needs disaggregated devices (pipeline.mode sync or "
                              f"flexmarl, mesh.colocate=False, no pipeline.emulate); got pipeline.mode="
                              f"{self.pipeline.mode!r}, mesh.colocate={self.mesh.colocate}")
        check_per_process(self, distributed.num_processes)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)
