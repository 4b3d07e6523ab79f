import dataclasses

import pytest

from flexmarl_jax.train.from_config import trainer_config_for


def test_agent_learning_rate_and_shapes(tiny_config):
    verifier = dataclasses.replace(tiny_config.agents["verifier"], learning_rate=5e-4)
    config = dataclasses.replace(tiny_config, agents={**tiny_config.agents, "verifier": verifier},
                                 train=dataclasses.replace(tiny_config.train, algorithm="dapo"))
    solver, verifier = (trainer_config_for(config, name) for name in ("solver", "verifier"))
    assert solver.optimizer.learning_rate == config.train.learning_rate
    assert verifier.optimizer.learning_rate == 5e-4
    assert solver.micro_batch_size == config.train.micro_batch_size
    assert solver.max_len == config.rollout.max_prompt_length + config.rollout.max_response_length - 1
    assert solver.loss.clip_eps_high == 0.28 and solver.loss.tis_cap is None


def test_staleness_turns_on_truncated_is_with_the_agents_sampling(tiny_config):
    config = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, max_staleness=1))
    assert trainer_config_for(config, "solver").loss.tis_cap == config.train.tis_cap == 2.0
    capped = dataclasses.replace(config, train=dataclasses.replace(config.train, tis_cap=3.5))
    assert trainer_config_for(capped, "solver").loss.tis_cap == 3.5
    solver = dataclasses.replace(config.agents["solver"], temperature=0.7, top_k=5, top_p=0.9)
    sampled = trainer_config_for(dataclasses.replace(config, agents={**config.agents, "solver": solver}), "solver")
    assert (sampled.sampling_temperature, sampled.sampling_top_k, sampled.sampling_top_p) == (0.7, 5, 0.9)
    assert trainer_config_for(config, "solver", kl_coef=0.1).loss.kl_coef == 0.1
    with pytest.raises(ValueError, match="unknown agent 'critic'; configured agents"):
        trainer_config_for(config, "critic")


def test_algorithm_names_match_the_registry():
    from flexmarl_jax.train.algorithm_names import ALGORITHM_NAMES
    from flexmarl_jax.train.algorithms import ALGORITHMS

    assert ALGORITHMS.names() == sorted(ALGORITHM_NAMES)


def test_precision_and_remat_come_from_the_agent_and_train_sections(tiny_config):
    verifier = dataclasses.replace(tiny_config.agents["verifier"], dtype="bfloat16", fp32_master_weights=True)
    config = dataclasses.replace(tiny_config, agents={**tiny_config.agents, "verifier": verifier},
                                 train=dataclasses.replace(tiny_config.train, remat=True))
    solver, verifier = (trainer_config_for(config, name) for name in ("solver", "verifier"))
    assert (solver.dtype, solver.fp32_master_weights, solver.remat) == ("float32", False, True)
    assert (verifier.dtype, verifier.fp32_master_weights, verifier.remat) == ("bfloat16", True, True)


def test_the_runs_kl_coef_reaches_the_trainers_loss_and_the_memory_estimate(tiny_config):
    from flexmarl_jax.config import ConfigError
    from flexmarl_jax.config.memory import agent_memory
    from flexmarl_jax.models.presets import get_preset

    assert trainer_config_for(tiny_config, "solver").loss.kl_coef == 0.0
    kl = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, kl_coef=0.05))
    assert trainer_config_for(kl, "solver").loss.kl_coef == 0.05
    assert trainer_config_for(kl, "solver", kl_coef=0.2).loss.kl_coef == 0.2  # an explicit override wins
    model = get_preset("tiny")
    without, with_reference = agent_memory(tiny_config, "solver", model), agent_memory(kl, "solver", model)
    # the frozen reference is one more copy of the policy's parameters, nothing else changes
    assert with_reference.params - without.params == without.params
    assert with_reference.optimizer == without.optimizer and with_reference.activations == without.activations
    with pytest.raises(ConfigError, match=r"^config.train.kl_coef=-0.1 must be >= 0$"):
        dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, kl_coef=-0.1))
