"""The embedded default: the chain workflow (solver -> verifier -> corrector) with tiny models on CPU.

`flexmarl train` with no flags runs this file. Every knob of the system appears here once, with its
default and what it does; the other files in configs/ build on it and change only their workflow.
Variants: `--config=configs/tiny.py:VARIANT` with VARIANT in VARIANTS, or several joined by commas
(`:sync,smoke`); single fields: `--config.train.learning_rate=3e-3`.
"""

from collections.abc import Callable

import ml_collections

AGENT_NAMES = ("solver", "verifier", "corrector")


def agent_config(model: str = "tiny") -> ml_collections.ConfigDict:
    """One agent's section (`config.agents.<name>`)."""
    agent = ml_collections.ConfigDict()
    agent.model = model  # model preset name (flexmarl_jax.models.presets) or a local HF checkpoint dir
    agent.temperature = 1.0  # sampling temperature used for rollouts (> 0)
    agent.top_k = 0  # keep the k most likely tokens; 0 = no top-k filter
    agent.top_p = 1.0  # nucleus sampling mass in (0, 1]
    agent.learning_rate = -1.0  # this agent's learning rate; -1 = use train.learning_rate
    agent.dtype = "float32"  # parameters and compute (training and rollout): float32 | bfloat16
    agent.fp32_master_weights = False  # bfloat16 only: the optimizer updates a float32 copy of the parameters
    agent.decode_slots = 0  # concurrent sequences per engine instance of this agent; 0 = rollout.decode_slots
    agent.stop_pattern = ""  # a regex: a response ends once its last 64 tokens hold a match; "" = none
    agent.lora = ml_collections.ConfigDict()  # train a LoRA adapter on a frozen base instead of the whole model
    agent.lora.rank = 0  # the adapter's rank; 0 = full fine-tuning (no adapter)
    agent.lora.alpha = 16.0  # the adapter's update is scaled by alpha / rank
    # the projections that carry an adapter, comma-separated among q_proj, k_proj, v_proj, o_proj, gate_proj,
    # up_proj, down_proj; "all" = the seven
    agent.lora.targets = "all"
    return agent


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/tiny.py")


def base_config() -> ml_collections.ConfigDict:
    """Every knob with its default: the chain team on the arithmetic task."""
    config = ml_collections.ConfigDict()
    config.seed = 0  # one seed drives task generation, parameter init, sampling and shuffling
    config.workdir = "runs/tiny"  # metrics.jsonl, plots, checkpoints and the store: a path, file:///ABS/PATH or gs://B/P
    config.iterations = 120  # RL iterations (one policy update per agent each)

    config.agents = ml_collections.ConfigDict()  # one entry per agent, keyed by its name
    for name in AGENT_NAMES:
        config.agents[name] = agent_config()

    config.workflow = ml_collections.ConfigDict()
    config.workflow.name = "chain"  # a registered workflow: chain | debate | mixture | dag
    # The workflow builder's own arguments (flexmarl_jax/workflows/builtin.py); chain's defaults here. Role
    # arguments (chain: agents, the solver, verifier and corrector roles in that order) hold role names.
    config.workflow.options = ml_collections.ConfigDict()
    config.workflow.options.corrector_runs = "rejected"  # chain: run the corrector when the verdict is N (or "always")
    # Role -> agent that plays it; a role not listed is played by the agent of its name. Two roles mapped to
    # one agent share its policy and trainer (see configs/debate.py:shared).
    config.workflow.roles = ml_collections.ConfigDict()
    config.workflow.roles.solver = "solver"  # chain: answers the query
    config.workflow.roles.verifier = "verifier"  # chain: judges the solver's answer (Y/N)
    config.workflow.roles.corrector = "corrector"  # chain: answers again when the verifier says N
    # Embedded task (arithmetic | countdown | reverse | word_problems) or a .jsonl path. The default, reverse: 4,608
    # distinct strings of 3-4 letters from a-h, about a fifth of them held out for eval.
    config.workflow.task = "reverse"
    # Each task's constructor arguments, one section per task; only the selected task's section is read (a
    # .jsonl path reads `jsonl`), so --config.workflow.task=... switches tasks with their own options.
    config.workflow.task_options = ml_collections.ConfigDict()
    config.workflow.task_options.arithmetic = ml_collections.ConfigDict()
    config.workflow.task_options.arithmetic.max_digits = 1  # digits per operand
    config.workflow.task_options.arithmetic.operators = "+"  # operators to draw from (subset of +-*)
    config.workflow.task_options.arithmetic.max_answer = 4  # redraw until the answer is at most this
    config.workflow.task_options.countdown = ml_collections.ConfigDict()
    config.workflow.task_options.countdown.count_numbers = 3  # numbers in each puzzle, all to be used
    config.workflow.task_options.countdown.max_number = 9  # numbers are drawn from 1..max_number
    config.workflow.task_options.reverse = ml_collections.ConfigDict()
    config.workflow.task_options.reverse.max_length = 4  # longest string to reverse
    config.workflow.task_options.word_problems = ml_collections.ConfigDict()
    config.workflow.task_options.word_problems.steps = "1,2"  # GSM8K-format questions of 1, 2 or both step counts
    config.workflow.task_options.word_problems.verifier = "math"  # math | numeric | exact
    config.workflow.task_options.jsonl = ml_collections.ConfigDict()
    config.workflow.task_options.jsonl.verifier = "numeric"  # exact (first line) | numeric (first number)
    # Per-agent reward shaping on top of the team reward; the keys are the workflow's shaping terms.
    config.workflow.shaping_weights = ml_collections.ConfigDict()
    config.workflow.shaping_weights.solver_correct = 1.0  # chain: the solver's own answer is right
    config.workflow.shaping_weights.verifier_judgement = 0.5  # chain: the verdict matches the truth
    config.workflow.shaping_weights.corrector_fix = 0.5  # chain: a wrong answer was fixed
    config.workflow.queries_per_iteration = 16  # distinct queries rolled out per iteration
    config.workflow.samples_per_query = 8  # trajectories per query (the GRPO group size)
    config.workflow.warmup_steps = 150  # supervised warm-up steps before the first RL iteration (0 = none)
    # The warm-up's own learning rate: it trains with a fresh optimizer, and RL then starts another fresh one at
    # the agents' learning rates (Adam moments carried over from a converged warm-up inflate RL's first steps).
    config.workflow.warmup_learning_rate = 3e-3
    # What the warm-up teaches, on training problems only: format (answers drawn independently of the truth:
    # the output format and nothing else) | sft (right answers: a supervised cold start).
    config.workflow.warmup = "sft"

    # Held-out evaluation (docs/workflows.md): the task's problems split into train and eval by content; the team
    # runs the eval problems at the start of RL, every `every` iterations and at the end, greedily
    # (eval_team_accuracy) and sampled (eval_pass_at_k); nothing of it is stored or trained.
    config.eval = ml_collections.ConfigDict()
    config.eval.enabled = True  # False: no held-out split (train on every problem) and no evals
    config.eval.every = 20  # evaluate after every this many iterations (>= 1), besides the start and the end
    config.eval.problems = 200  # distinct eval problems (fewer when the eval split has fewer)
    config.eval.samples = 8  # sampled trajectories per eval problem: the k of eval_pass_at_k
    config.eval.fraction = 0.2  # share of the task's problem contents held out for eval (by a hash of the prompt)
    config.eval.file = ""  # .jsonl tasks: eval problems from this JSONL file instead of eval.fraction of the task's

    config.rollout = ml_collections.ConfigDict()
    config.rollout.instances_per_agent = 1  # engine instances serving each agent
    config.rollout.decode_slots = 32  # concurrent sequences per engine instance
    config.rollout.max_prompt_length = 32  # tokens; longer prompts are an error
    config.rollout.max_response_length = 8  # max new tokens per call
    config.rollout.min_instances_per_agent = 1  # balancing never leaves an agent with fewer instances
    config.rollout.request_timeout_s = 0.0  # cancel and re-queue a request running longer; 0 = no timeout
    config.rollout.max_retries = 2  # re-queues of a timed-out request before it is reported failed
    # An instance that holds requests but finishes no engine step for this long (a crashed thread, a hung step)
    # is taken out of routing and its requests go to the agent's other instances; below run.stall_timeout_s.
    # Long enough for the slowest first-step compile of a real checkpoint.
    config.rollout.instance_stall_s = 120.0

    config.train = ml_collections.ConfigDict()
    config.train.algorithm = "grpo"  # grpo | drgrpo | dapo | ppo (GAE with a critic per agent)
    # Default optimizer learning rate of every agent in RL. After the sft warm-up (at warmup_learning_rate), RL at
    # 3e-3 or 1e-3 unlearns the task on held-out problems; 3e-4 learns it (README, "What the default run does").
    config.train.learning_rate = 3e-4
    # The global batch, samples per agent per iteration, is workflow.queries_per_iteration x samples_per_query.
    config.train.micro_batch_size = 32  # samples per gradient micro-batch; must divide the global batch
    config.train.max_staleness = 0  # 0 = strict on-policy; k > 0 lets rollout run k versions ahead
    config.train.tis_cap = 2.0  # max_staleness > 0: cap (>= 1) of each token's importance weight pi_old / pi_behaviour
    config.train.remat = False  # rematerialise each decoder layer in training: less memory, ~1 more forward
    config.train.rows_per_pass = 0  # rows of one forward+backward pass (divides micro_batch_size); 0 = all
    config.train.pack_rows = False  # pack each micro-batch's sequences into as few rows as hold them (same loss)
    config.train.kl_coef = 0.0  # weight of the KL to each agent's frozen initial policy; > 0 keeps that copy in memory
    # Rows of advantage 0 (a group whose samples all got one reward) add exactly nothing where the loss reads
    # nothing else of them: the step leaves them out (train/rows_without_signal.py).
    config.train.skip_rows_without_signal = True

    config.mesh = ml_collections.ConfigDict()
    config.mesh.fake_cpu_devices = 8  # on a CPU host, fake this many XLA devices (ignored on TPU/GPU)
    config.mesh.rollout_devices_per_instance = 1  # devices under each engine instance
    config.mesh.train_devices_per_agent = 1  # devices in each agent's training mesh (fsdp x tp)
    config.mesh.tp = 1  # tensor-parallel degree inside a training mesh (divides train_devices_per_agent)
    config.mesh.train_slices = 0  # training slices shared by all agents; 0 = a dedicated slice per agent
    config.mesh.colocate = False  # agents' rollout and training share devices (one GPU, a one-device CPU)

    config.store = ml_collections.ConfigDict()
    config.store.backend = "memory"  # memory (TensorStore memory driver) | file (ocdbt under WORKDIR/store)

    config.pipeline = ml_collections.ConfigDict()
    config.pipeline.mode = "flexmarl"  # serial | sync | flexmarl (see docs/architecture.md)
    config.pipeline.async_micro_batches = True  # flexmarl only: train micro-batches while rollout runs
    config.pipeline.balancing = True  # flexmarl only: hierarchical load balancing across instances
    config.pipeline.balance_delta = 5  # move instances when max - min agent queue length exceeds this
    config.pipeline.balance_cooldown_s = 1.0  # a moved instance stays with its new agent at least this long
    config.pipeline.balance_poll_s = 0.02  # how often the balancer polls queue lengths
    config.pipeline.debug_invariants = False  # check consistency invariants at run time (slower)
    # Train after each rollout with micro-batches cut in group-id order: two runs with one seed end with
    # bit-identical parameters. Needs train.max_staleness=0; False keeps training overlapped with rollout.
    config.pipeline.deterministic = False
    # Emulated devices (flexmarl_jax/emulation/): "CHIP:MODEL", e.g. "v5p:qwen2.5-14b" (chips: v5e v5p v6e h100
    # h200; a model preset or an HF config.json). The control plane runs for real; every engine step, training
    # micro-batch, apply and weight sync takes the cost model's time on that chip, and tokens are scripted
    # (no model runs, so a 14B team fits on this host). Chips per engine instance: mesh.rollout_devices_per_instance;
    # per training mesh: mesh.train_devices_per_agent. "" = off: real models on real devices.
    config.pipeline.emulate = ""
    config.pipeline.emulate_compression = 1.0  # emulated device seconds per wall second (>= 1; 1 = real time)
    config.pipeline.emulate_mfu = 0.4  # share of the chips' peak FLOP/s an emulated training step reaches, in (0, 1]
    # Scripted response tokens: long-tailed (log-normal) around this median, capped at rollout.max_response_length;
    # 0 = every response is rollout.max_response_length tokens
    config.pipeline.emulate_median_response = 0
    # Link a weight sync crosses, one per chip in parallel: dcn100 | pcie4 | pcie5 | interconnect (the chip's own)
    config.pipeline.emulate_sync_link = "dcn100"
    # Decode steps an emulated engine advances per call at most, each charged as a single step (1 = one per call,
    # like a real engine). Many per call keep this host's per-call overhead below 10% of the emulated step.
    config.pipeline.emulate_tokens_per_call = 64

    # Hangs and stops (docs/architecture.md, "Failures"). When no iteration, micro-batch or decode step made progress
    # for stall_timeout_s (> 0), the run writes every thread's stack to the log, marks its journal (stops.jsonl)
    # and exits non-zero; every wait in the pipeline ends by then. Longer than the slowest micro-batch or checkpoint.
    config.run = ml_collections.ConfigDict()
    config.run.stall_timeout_s = 600.0
    config.run.stop_mode = "finish"  # SIGTERM/SIGINT: finish | abandon the running iteration; a second signal abandons
    config.run.stop_timeout_s = 300.0  # a signalled stop ends the process within this many seconds

    # Several processes, one per host (docs/architecture.md, "Several hosts"): each joins JAX's distributed runtime
    # before anything runs, and the run places its meshes on the global device set. The defaults mean one process.
    config.distributed = ml_collections.ConfigDict()
    config.distributed.enabled = False  # True: join the other processes (jax.distributed.initialize)
    config.distributed.coordinator_address = ""  # HOST:PORT of process 0's coordinator; "" = auto-detect (Cloud TPU)
    config.distributed.num_processes = 0  # processes in the run; 0 = auto-detect
    config.distributed.process_id = -1  # this process's index; -1 = auto-detect
    config.distributed.init_timeout_s = 300.0  # the coordinator must answer and every process join within this
    config.distributed.heartbeat_timeout_s = 30.0  # a process silent this long is lost and the others stop

    return config


def _smoke(config: ml_collections.ConfigDict) -> None:
    """Seconds-long runs for tests: 2 iterations of 4 queries x 4 samples, evals of 4 problems x 2 samples."""
    config.iterations = 2
    config.workflow.queries_per_iteration = 4
    config.workflow.samples_per_query = 4
    config.workflow.warmup_steps = 2
    config.train.micro_batch_size = 8
    config.eval.every = 2  # evals at the start and the end
    config.eval.problems = 4
    config.eval.samples = 2


def _faults(config: ml_collections.ConfigDict) -> None:
    """The smoke run set up for fault injection (`flexmarl bench faults`, tests): a durable store, two engine
    instances per agent (a failed one's requests have somewhere to go), request timeouts on, and stall limits
    short enough for trials."""
    _smoke(config)
    config.iterations = 4
    config.store.backend = "file"
    config.rollout.instances_per_agent = 2
    config.mesh.fake_cpu_devices = 3 * len(config.agents)  # two rollout devices and one training device each
    config.rollout.request_timeout_s = 20.0
    # A step that compiles a new prompt-length bucket took over 10 s on the loaded 2-core host with a cold XLA cache,
    # which took both instances of an agent out of a clean run (bench faults' calibration); 30 s does not.
    config.rollout.instance_stall_s = 30.0
    config.run.stall_timeout_s = 60.0
    config.run.stop_timeout_s = 60.0


def _set(**fields) -> Callable[[ml_collections.ConfigDict], None]:
    """A variant that sets dotted fields (`pipeline__mode="sync"` sets config.pipeline.mode)."""

    def change(config: ml_collections.ConfigDict) -> None:
        for dotted, value in fields.items():
            *sections, leaf = dotted.split("__")
            node = config
            for section in sections:
                node = node[section]
            node[leaf] = value

    return change


# Variants every config file built on this one offers: pipeline modes, one-version staleness, smoke sizes.
VARIANT_CHANGES: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "sync": _set(pipeline__mode="sync"),  # disaggregated, train after the whole rollout
    "serial": _set(pipeline__mode="serial"),  # rollout and training colocated, queries one at a time
    "stale1": _set(train__max_staleness=1),  # rollout may run one policy version ahead
    "smoke": _smoke,
    "faults": _faults,  # smoke, durable store, 2 instances per agent, request timeouts: for fault injection
}
VARIANTS = tuple(VARIANT_CHANGES)


def apply_variants(config: ml_collections.ConfigDict, variant: str | None,
                   changes: dict[str, Callable[[ml_collections.ConfigDict], None]],
                   file: str) -> ml_collections.ConfigDict:
    """Applies comma-separated variant names in order; an unknown name raises naming the allowed ones."""
    for name in filter(None, (part.strip() for part in (variant or "").split(","))):
        if name not in changes:
            raise ValueError(f"unknown variant {name!r} of {file}; allowed: {', '.join(changes)}")
        changes[name](config)
    return config
