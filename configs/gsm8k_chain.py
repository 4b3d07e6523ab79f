"""GSM8K with the chain workflow on real checkpoints: a Qwen2.5-1.5B-Instruct solver, Qwen2.5-0.5B-Instruct
verifier and corrector. docs/recipes.md says where to get the checkpoints and the data, and what to expect.

Builds on configs/tiny.py (every knob not set here is explained there). The checkpoint and data paths are
fields: `--config.agents.solver.model=/path/to/Qwen2.5-1.5B-Instruct`, `--config.workflow.task=/path/train.jsonl`.
Variants (`--config=configs/gsm8k_chain.py:VARIANT`; several joined by commas, with those of configs/tiny.py):
  tpu_v5e_8   one TPU VM host with 8 v5e chips: an engine chip per agent, one shared 4-chip training slice
  tpu_v5e_32  a v5e-32 pod slice (8 TPU VM workers of 4 chips, one process each): 8 engine chips per agent and
              one shared 8-chip training slice that spans two workers (docs/launch.md runs it)
  gpu_1       one 80 GB GPU: every agent's rollout and training colocated on it
  cpu_smoke   this CPU: synthetic checkpoints of the same shape family (made on first use, about 10 s) and a
              small GSM8K-format file, 2 iterations
"""

import os

import ml_collections

from flexmarl_jax.configs import tiny

HERE = os.path.dirname(os.path.abspath(__file__))
SMOKE_DATA = os.path.join(HERE, "data", "gsm8k_smoke.jsonl")


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return tiny.apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/gsm8k_chain.py")


def base_config() -> ml_collections.ConfigDict:
    config = tiny.base_config()
    config.workdir = "runs/gsm8k_chain"
    config.iterations = 200

    # Where `huggingface-cli download` put the checkpoints (docs/recipes.md): $FLEXMARL_CHECKPOINTS, or ./checkpoints.
    checkpoints = os.environ.get("FLEXMARL_CHECKPOINTS", "checkpoints")
    agents = config.agents
    agents.solver.model = os.path.join(checkpoints, "Qwen2.5-1.5B-Instruct")
    agents.verifier.model = os.path.join(checkpoints, "Qwen2.5-0.5B-Instruct")
    agents.corrector.model = os.path.join(checkpoints, "Qwen2.5-0.5B-Instruct")
    for agent in agents.values():
        agent.temperature = 1.0
        agent.dtype = "bfloat16"  # parameters and compute
        agent.fp32_master_weights = True  # the optimizer updates an f32 copy; rollout serves its bf16 cast
    agents.solver.learning_rate = 1e-6
    agents.verifier.learning_rate = 2e-6
    agents.corrector.learning_rate = 2e-6

    workflow = config.workflow
    workflow.options.chat = True  # natural-language role prompts rendered with each checkpoint's chat template
    workflow.options.max_field_tokens = 512  # what the verifier and corrector see of an earlier response
    workflow.task = os.path.join(os.environ.get("FLEXMARL_DATA", "data"), "gsm8k", "train.jsonl")
    workflow.task_options.jsonl.verifier = "math"  # math-verify: 42, 42.0, $42$ and \boxed{42} all match 42
    workflow.shaping_weights.solver_correct = 0.0  # the team reward alone for the solver, as in MARTI's chain
    workflow.queries_per_iteration = 32
    workflow.samples_per_query = 8
    workflow.warmup_steps = 0  # instruct checkpoints already answer in a format

    # Held out: eval.fraction of train.jsonl's questions. GSM8K's own test split is the usual eval set instead:
    # --config.eval.file=$FLEXMARL_DATA/gsm8k/test.jsonl (training then drops any question it shares with it).
    config.eval.every = 20
    config.eval.problems = 200
    config.eval.samples = 4  # 4 sampled solutions per question: eval_pass_at_k is pass@4

    rollout = config.rollout
    rollout.decode_slots = 64
    rollout.max_prompt_length = 1024  # the chat template, the question and a quoted 512-token response
    rollout.max_response_length = 1024
    rollout.request_timeout_s = 0.0

    config.train.learning_rate = 1e-6
    config.train.micro_batch_size = 16
    config.train.remat = True  # recompute each layer's activations in the backward pass: 2k-token rows fit
    config.train.rows_per_pass = 1  # one row per pass: its float32 logits over 152k ids are 1.2 GiB already

    config.mesh.fake_cpu_devices = 8
    return config


def _tpu_v5e_8(config: ml_collections.ConfigDict) -> None:
    """8 chips of 16 GiB: an engine chip per agent, and one 4-chip training slice that each agent takes while
    it has micro-batches (agent-centric allocation): the solver's training state (~33 GiB with float32 master
    weights and Adam moments) needs 4 chips, and it would sit idle most of an iteration as a dedicated mesh."""
    config.mesh.rollout_devices_per_instance = 1
    config.mesh.train_devices_per_agent = 4
    config.mesh.train_slices = 1
    config.rollout.instances_per_agent = 1


def _tpu_v5e_32(config: ml_collections.ConfigDict) -> None:
    """32 chips of 16 GiB on 8 workers, one process per worker joined by JAX's distributed runtime (coordinator,
    process count and index auto-detected from the TPU metadata). Rollout gets 24 chips: 8 one-chip engine
    instances per agent, so no engine spans two workers and the balancer has whole chips to move between agents;
    their 8 x 64 decode slots hold one iteration's 64 queries x 8 samples of an agent at once. Training gets the
    other 8 chips as one slice that the agents take in turn (as on tpu_v5e_8): the solver's ~33 GiB of training
    state is ~4.2 GiB a chip there, and the slice's mesh spans all 8 workers, one chip of each."""
    config.distributed.enabled = True  # launch/tpu_vm.sh train sets it too; here so a hand-started run joins
    config.pipeline.deterministic = True  # every process replays one rollout (docs/architecture.md, "Several hosts")
    config.mesh.fake_cpu_devices = 32  # on a CPU host (config checks, tests): the pod slice's global device count
    config.mesh.rollout_devices_per_instance = 1
    config.rollout.instances_per_agent = 8  # 3 agents x 8 x 1 chip = 24 chips
    config.mesh.train_devices_per_agent = 8
    config.mesh.train_slices = 1  # + 1 x 8 chips = 32
    config.workflow.queries_per_iteration = 64


def _gpu_1(config: ml_collections.ConfigDict) -> None:
    """One 80 GB GPU shared by the whole team."""
    config.mesh.colocate = True
    config.mesh.train_devices_per_agent = 1
    config.rollout.instances_per_agent = 1
    config.rollout.decode_slots = 32
    config.pipeline.balancing = False  # one instance per agent on one device: nothing to move


def _cpu_smoke(config: ml_collections.ConfigDict) -> None:
    """Synthetic checkpoints (models/synthetic.py) of two sizes sharing a tokenizer, as 1.5B and 0.5B do."""
    from flexmarl_jax.models.fixture_cache import synthetic_checkpoint

    config.workdir = "runs/gsm8k_chain_smoke"
    config.agents.solver.model = synthetic_checkpoint("qwen2", size="small")
    config.agents.verifier.model = synthetic_checkpoint("qwen2", size="smoke")
    config.agents.corrector.model = config.agents.verifier.model
    for agent in config.agents.values():
        agent.dtype = "float32"
        agent.fp32_master_weights = False
        agent.learning_rate = 1e-4
    config.workflow.task = SMOKE_DATA
    config.workflow.options.max_field_tokens = 32
    config.workflow.queries_per_iteration = 4
    config.workflow.samples_per_query = 4
    config.rollout.decode_slots = 16
    config.rollout.max_prompt_length = 256  # the chat template, a question and a quoted 32-token response
    config.rollout.max_response_length = 32
    config.train.micro_batch_size = 8
    config.train.remat = False
    config.train.rows_per_pass = 0
    config.iterations = 2
    config.eval.every = 2
    config.eval.problems = 4
    config.eval.samples = 2


VARIANT_CHANGES = {**tiny.VARIANT_CHANGES, "tpu_v5e_8": _tpu_v5e_8, "tpu_v5e_32": _tpu_v5e_32,
                   "gpu_1": _gpu_1, "cpu_smoke": _cpu_smoke}
VARIANTS = tuple(VARIANT_CHANGES)
