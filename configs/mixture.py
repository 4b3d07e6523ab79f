"""Mixture of agents: three proposers answer independently; an aggregator reads their answers and decides.

Builds on configs/tiny.py: every knob not set here keeps its value there (where each one is explained).
Variants (`--config=configs/mixture.py:VARIANT`, several joined by commas): those of configs/tiny.py, plus
  shared   the three proposers are one agent ("proposer": one policy sampled three times).
"""

import ml_collections

from flexmarl_jax.configs import tiny

PROPOSERS = ("proposer0", "proposer1", "proposer2")


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return tiny.apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/mixture.py")


def base_config() -> ml_collections.ConfigDict:
    config = tiny.base_config()
    config.workdir = "runs/mixture"
    config.iterations = 60  # each query takes 4 calls (3 proposers, 1 aggregator): about 5 minutes here
    # The settings this team was tuned with before the default moved to the reverse task with an sft warm-up and
    # RL at 3e-4 (configs/tiny.py); not re-tuned since.
    config.workflow.task = "arithmetic"
    config.workflow.warmup = "format"
    config.train.learning_rate = 1e-3  # 3e-3 collapses the aggregator's entropy after ~50 iterations

    config.agents = ml_collections.ConfigDict()
    for name in (*PROPOSERS, "aggregator"):
        config.agents[name] = tiny.agent_config()

    workflow = config.workflow
    workflow.name = "mixture"
    workflow.options = ml_collections.ConfigDict()  # the mixture builder's arguments (workflows/builtin.py)
    workflow.options.proposers = PROPOSERS  # the proposer roles, in the order the aggregator reads them
    workflow.options.aggregator = "aggregator"  # the aggregator's role
    workflow.roles = ml_collections.ConfigDict()  # role -> agent that plays it
    for name in (*PROPOSERS, "aggregator"):
        workflow.roles[name] = name
    workflow.shaping_weights = ml_collections.ConfigDict()
    workflow.shaping_weights.proposal_correct = 0.5  # a proposer's own answer is right
    return config


def _shared(config: ml_collections.ConfigDict) -> None:
    for name in PROPOSERS:
        config.workflow.roles[name] = "proposer"
        del config.agents[name]
    config.agents.proposer = tiny.agent_config()


VARIANT_CHANGES = {**tiny.VARIANT_CHANGES, "shared": _shared}
VARIANTS = tuple(VARIANT_CHANGES)
