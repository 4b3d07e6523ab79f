"""Engine shapes per agent (rollout/settings.py `engine_config_for`)."""

import dataclasses

from flexmarl_jax.rollout.settings import engine_config_for


def test_each_agent_gets_its_own_decode_slots(tiny_config):
    verifier = dataclasses.replace(tiny_config.agents["verifier"], decode_slots=4)
    config = dataclasses.replace(tiny_config, agents={**tiny_config.agents, "verifier": verifier})
    assert engine_config_for(config, "verifier").max_concurrent_decodes == 4
    solver = engine_config_for(config, "solver")  # 0 = rollout.decode_slots
    assert solver.max_concurrent_decodes == config.rollout.decode_slots == 32
    assert solver.cache_length == config.rollout.max_prompt_length + config.rollout.max_response_length
