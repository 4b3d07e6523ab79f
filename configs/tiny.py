"""The embedded default: the chain workflow (solver -> verifier -> corrector) with tiny models on CPU.

`flexmarl train` with no flags runs this file. Every knob of the system appears here once, with its
default and what it does. Variants: `--config=configs/tiny.py:VARIANT` with VARIANT in
{sync, serial, stale1, smoke}; single fields: `--config.train.learning_rate=3e-3`.
"""

import ml_collections

AGENT_NAMES = ("solver", "verifier", "corrector")


def _agent(model: str = "tiny") -> ml_collections.ConfigDict:
    agent = ml_collections.ConfigDict()
    agent.model = model  # model preset name (flexmarl_jax.models.presets) or a local HF checkpoint dir
    agent.temperature = 1.0  # sampling temperature used for rollouts (> 0)
    agent.top_k = 0  # keep the k most likely tokens; 0 = no top-k filter
    agent.top_p = 1.0  # nucleus sampling mass in (0, 1]
    agent.learning_rate = -1.0  # this agent's learning rate; -1 = use train.learning_rate
    return agent


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # one seed drives task generation, parameter init, sampling and shuffling
    config.workdir = "runs/tiny"  # metrics.jsonl, plots, checkpoints and the store live here
    config.iterations = 200  # RL iterations (one policy update per agent each)

    config.agents = ml_collections.ConfigDict()  # one entry per agent, keyed by its name
    for name in AGENT_NAMES:
        config.agents[name] = _agent()

    config.workflow = ml_collections.ConfigDict()
    config.workflow.name = "chain"  # chain | debate | mixture
    config.workflow.agents = AGENT_NAMES  # agents in the workflow's role order (chain: solver, verifier, corrector)
    config.workflow.task = "arithmetic"  # embedded task (arithmetic | countdown | reverse) or a .jsonl path
    config.workflow.task_options = ml_collections.ConfigDict()  # keyword arguments of the task's constructor
    config.workflow.task_options.max_digits = 1  # arithmetic: digits per operand
    config.workflow.task_options.operators = "+"  # arithmetic: operators to draw from
    config.workflow.task_options.max_answer = 4  # arithmetic: redraw until the answer is at most this
    # Per-agent reward shaping on top of the team reward (names depend on the workflow; chain's below).
    config.workflow.shaping_weights = ml_collections.ConfigDict()
    config.workflow.shaping_weights.solver_correct = 1.0  # chain: the solver's own answer is right
    config.workflow.shaping_weights.verifier_judgement = 0.5  # chain: the verdict matches the truth
    config.workflow.shaping_weights.corrector_fix = 0.5  # chain: a wrong answer was fixed
    config.workflow.queries_per_iteration = 16  # distinct queries rolled out per iteration
    config.workflow.samples_per_query = 8  # trajectories per query (the GRPO group size)
    config.workflow.warmup_steps = 150  # format-only supervised warm-up steps before the first RL iteration

    config.rollout = ml_collections.ConfigDict()
    config.rollout.instances_per_agent = 1  # engine instances serving each agent
    config.rollout.decode_slots = 32  # concurrent sequences per engine instance
    config.rollout.max_prompt_length = 32  # tokens; longer prompts are an error
    config.rollout.max_response_length = 8  # max new tokens per call
    config.rollout.min_instances_per_agent = 1  # balancing never leaves an agent with fewer instances
    config.rollout.request_timeout_s = 0.0  # cancel and re-queue a request running longer; 0 = no timeout
    config.rollout.max_retries = 2  # re-queues of a timed-out request before it is reported failed

    config.train = ml_collections.ConfigDict()
    config.train.algorithm = "grpo"  # grpo | drgrpo | ppo
    config.train.learning_rate = 3e-3  # default optimizer learning rate of every agent
    config.train.global_batch_size = 128  # samples per agent per iteration (queries x samples_per_query)
    config.train.micro_batch_size = 32  # samples per gradient micro-batch; must divide global_batch_size
    config.train.max_staleness = 0  # 0 = strict on-policy; k > 0 lets rollout run k versions ahead

    config.mesh = ml_collections.ConfigDict()
    config.mesh.fake_cpu_devices = 8  # on a CPU host, fake this many XLA devices (ignored on TPU/GPU)
    config.mesh.rollout_devices_per_instance = 1  # devices under each engine instance
    config.mesh.train_devices_per_agent = 1  # devices in each agent's training mesh (fsdp x tp)
    config.mesh.tp = 1  # tensor-parallel degree inside a training mesh (divides train_devices_per_agent)
    config.mesh.train_slices = 0  # training slices shared by all agents; 0 = a dedicated slice per agent

    config.store = ml_collections.ConfigDict()
    config.store.backend = "memory"  # memory (TensorStore memory driver) | file (ocdbt under workdir)
    config.store.path = ""  # durable store location; empty = WORKDIR/store

    config.pipeline = ml_collections.ConfigDict()
    config.pipeline.mode = "flexmarl"  # serial | sync | flexmarl (see ARCHITECTURE.md)
    config.pipeline.async_micro_batches = True  # flexmarl only: train micro-batches while rollout runs
    config.pipeline.balancing = True  # flexmarl only: hierarchical load balancing across instances
    config.pipeline.balance_delta = 5  # move instances when max - min agent queue length exceeds this
    config.pipeline.balance_cooldown_s = 1.0  # a moved instance stays with its new agent at least this long
    config.pipeline.balance_poll_s = 0.02  # how often the balancer polls queue lengths
    config.pipeline.debug_invariants = False  # check consistency invariants at run time (slower)

    if variant in (None, ""):
        pass
    elif variant in ("sync", "serial"):
        config.pipeline.mode = variant
    elif variant == "stale1":
        config.train.max_staleness = 1
    elif variant == "smoke":  # seconds-long run for tests
        config.iterations = 2
        config.workflow.queries_per_iteration = 4
        config.workflow.samples_per_query = 4
        config.workflow.warmup_steps = 2
        config.train.global_batch_size = 16
        config.train.micro_batch_size = 8
    else:
        raise ValueError(f"unknown variant {variant!r} of configs/tiny.py; allowed: sync, serial, stale1, smoke")
    return config
