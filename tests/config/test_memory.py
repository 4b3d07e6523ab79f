"""Memory estimates per agent (numbers by hand and against XLA's own plan) and the team-fits check."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.config import ConfigError
from flexmarl_jax.config.memory import GIB, AgentMemory, check_team_fits, estimate_agent_memory
from flexmarl_jax.models import functional
from flexmarl_jax.models.presets import get_preset

# Qwen2.5-0.5B by hand: per layer q/k/v/o 896*64*(2*14 + 2*2), q/k/v biases 64*(14 + 2*2), SwiGLU 3*896*4864,
# two norms 2*896; 24 layers, tied embedding 151936*896, final norm 896.
QWEN_05B_LAYER = 896 * 64 * (2 * 14 + 2 * 2) + 64 * (14 + 2 * 2) + 3 * 896 * 4864 + 2 * 896
QWEN_05B_PARAMS = 24 * QWEN_05B_LAYER + 151936 * 896 + 896


def test_qwen_0_5b_estimate_matches_a_hand_computation():
    assert QWEN_05B_LAYER == 14_912_384 and QWEN_05B_PARAMS == 494_032_768  # the published 494M
    p = QWEN_05B_PARAMS
    memory = estimate_agent_memory(get_preset("qwen2.5-0.5b"), dtype="bfloat16", fp32_master_weights=True,
                                   optimizer="adamw", train_rows=4, train_len=256, remat=True, decode_slots=16,
                                   cache_length=512, instances=2)
    tokens = 4 * 256
    # saved per token and layer in bfloat16: 4h + 2*H*d + 2*K*d + 3m; attention: 14 heads x 256 keys x (4 + 2) bytes
    per_layer = tokens * (2 * (4 * 896 + 2 * 14 * 64 + 2 * 2 * 64 + 3 * 4864) + 14 * 256 * 6)
    assert per_layer == 63_438_848
    logits = tokens * 151936 * 4 * 3
    assert memory == AgentMemory(
        params=2 * p,  # bfloat16
        optimizer=4 * p + 2 * 4 * p,  # float32 master copy + two float32 Adam moments
        grads=4 * p + 2 * p,  # float32 accumulator + one bfloat16 micro-batch gradient
        activations=24 * tokens * 896 * 2 + 2 * per_layer + logits,  # remat: layer inputs + one layer twice
        rollout_params=2 * 2 * p,  # two instances, each its own bfloat16 copy
        kv_cache=2 * (2 * 24 * 16 * 512 * 2 * 64 * 2 + 16 * 151936 * 4),  # k and v, plus next-token logits
    )
    assert memory.total == 24 * p + memory.activations + memory.kv_cache == 14_115_468_288  # ~13.1 GiB
    plain = estimate_agent_memory(get_preset("qwen2.5-0.5b"), dtype="float32", fp32_master_weights=False,
                                  train_rows=4, train_len=256, remat=False, decode_slots=16, cache_length=512,
                                  instances=1)
    assert (plain.params, plain.optimizer, plain.grads) == (4 * p, 8 * p, 8 * p)
    assert plain.activations == 25 * tokens * (4 * (4 * 896 + 2 * 14 * 64 + 2 * 2 * 64 + 3 * 4864)
                                               + 14 * 256 * 8) + logits
    with pytest.raises(ValueError, match="optimizer='lion' is not allowed; choose one of: adam, adamw, sgd"):
        estimate_agent_memory(get_preset("tiny"), dtype="float32", fp32_master_weights=False, optimizer="lion",
                              train_rows=1, train_len=8, remat=False, decode_slots=1, cache_length=8, instances=1)


@pytest.mark.parametrize("remat", [False, True])
def test_activation_estimate_is_close_to_xla_plan(remat):
    """The backward pass of one micro-batch: the estimate within 35% of XLA's temporary buffers (CPU)."""
    config = dataclasses.replace(get_preset("tiny"), num_layers=4)
    graphdef, params = functional.abstract_model(config)
    rows, length = 8, 256
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((rows, length), jnp.bool_)

    def loss(params, tokens, mask):
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
        logits = functional.forward(graphdef, params, tokens, positions, mask, remat=remat)
        return jnp.sum(functional.token_logprobs(logits, tokens))

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
    xla_bytes = compiled.memory_analysis().temp_size_in_bytes
    estimate = estimate_agent_memory(config, dtype="float32", fp32_master_weights=False, train_rows=rows,
                                     train_len=length, remat=remat, decode_slots=1, cache_length=8, instances=1)
    assert 0.65 < estimate.activations / xla_bytes < 1.35, (estimate.activations, xla_bytes)


def _team(tiny_config, solver_model: str, **solver_changes):
    solver = dataclasses.replace(tiny_config.agents["solver"], model=solver_model, **solver_changes)
    config = dataclasses.replace(tiny_config, agents={**tiny_config.agents, "solver": solver})
    return config, {agent: get_preset(settings.model) for agent, settings in config.agents.items()}


def test_a_14b_float32_team_does_not_fit_and_says_so_in_one_line(tiny_config):
    config, models = _team(tiny_config, "qwen2.5-14b")
    endings = {"cpu": "; with the other agents the team needs ~350.9 GiB of host memory (the fake CPU devices "
                      "share it) but 80.0 GiB are available",
               "gpu": ", ~295.4 GiB per device of its training mesh (mesh.train_devices_per_agent=1), but 80.0 GiB "
                      "are available on each device"}
    for platform, ending in endings.items():
        with pytest.raises(ConfigError) as error:
            check_team_fits(config, models, 80 * GIB, platform=platform)
        assert str(error.value) == ("config.agents.solver (qwen2.5-14b, float32) needs ~350.9 GiB (params 55.0, "
                                    "optimizer 110.0, grads 110.0, activations 20.3, rollout params 55.0, kv cache "
                                    "0.5 GiB)" + ending)
    with pytest.raises(ConfigError, match=r"of host memory \(the fake CPU devices share it\) but [\d.]+ GiB are "):
        check_team_fits(config, models, platform="cpu")  # this host's RAM


def test_a_tiny_team_fits_this_host(tiny_config):
    estimates = check_team_fits(tiny_config, {agent: get_preset("tiny") for agent in tiny_config.agents})
    assert set(estimates) == set(tiny_config.agents)
    assert all(0 < memory.total < 64 * 2**20 for memory in estimates.values())


def test_on_an_accelerator_each_agent_must_fit_its_devices(tiny_config):
    config, models = _team(tiny_config, "qwen2.5-1.5b", dtype="bfloat16")
    assert len(jax.devices()) >= 6  # 3 agents x (1 instance + 1 training device): one device each, not shared
    estimates = check_team_fits(config, models, 80 * GIB, platform="gpu")
    assert 16 * GIB < estimates["solver"].training < 80 * GIB
    with pytest.raises(ConfigError, match=r"^config.agents.solver \(qwen2.5-1.5b, bfloat16\) needs ~[\d.]+ GiB "
                                          r"\(params 2.9, .*\), ~[\d.]+ GiB per device of its training mesh "
                                          r"\(mesh.train_devices_per_agent=1\), but 16.0 GiB are available on each "
                                          r"device$"):
        check_team_fits(config, models, 16 * GIB, platform="gpu")
    # spread over 8 training devices (one FSDP mesh per agent would need 3 x 9 slots: agents then share devices)
    wide = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, train_devices_per_agent=8))
    with pytest.raises(ConfigError, match=r"team needs ~[\d.]+ GiB on the 8 device\(s\) its agents share but "
                                          r"16.0 GiB are available"):
        check_team_fits(wide, models, 2 * GIB, platform="gpu")
    assert np.isclose(sum(m.total for m in check_team_fits(wide, models, 16 * GIB, platform="gpu").values()),
                      sum(m.total for m in estimates.values()))


def test_a_lora_base_group_counts_one_base_per_device(tiny_config):
    """Solver and verifier as adapters on one 1.5B base, the corrector a full fine-tune of it. The verifier decodes
    on the solver's instances (one base there, and a table of both adapters), and on one shared training slice the
    group keeps one base on the slice and one on the host instead of one per agent."""
    from flexmarl_jax.config import LoraConfig
    from flexmarl_jax.config.memory import agent_memory
    from flexmarl_jax.models.lora_targets import adapter_parameter_count

    ranks = {"solver": 16, "verifier": 8, "corrector": 0}
    agents = {name: dataclasses.replace(settings, model="qwen2.5-1.5b", lora=LoraConfig(rank=ranks[name]))
              for name, settings in tiny_config.agents.items()}
    model = get_preset("qwen2.5-1.5b")
    models = {agent: model for agent in agents}
    base = model.num_params() * 4
    adapters = sum(adapter_parameter_count(model, rank, agents["solver"].lora.target_names) for rank in (16, 8))
    dedicated = dataclasses.replace(tiny_config, agents=agents)
    alone = {agent: agent_memory(dedicated, agent, model) for agent in agents}  # each agent as if by itself
    estimates = check_team_fits(dedicated, models, 10_000 * GIB, platform="cpu")
    assert estimates["verifier"].rollout == 0 and estimates["corrector"] == alone["corrector"]
    assert estimates["solver"].rollout == alone["solver"].rollout + 2 * adapters * 4  # a current and a spare row
    assert estimates["verifier"].params == alone["verifier"].params  # on a mesh of its own: a base of its own
    assert sum(m.total for m in alone.values()) - sum(m.total for m in estimates.values()) == (
        alone["verifier"].rollout - 2 * adapters * 4)

    one_slice = dataclasses.replace(dedicated, mesh=dataclasses.replace(dedicated.mesh, train_slices=1))
    shared = check_team_fits(one_slice, models, 10_000 * GIB, platform="cpu")
    assert shared["verifier"].params == alone["verifier"].params - base
    assert shared["solver"].params == alone["solver"].params + base  # the group's host copy
    on_gpu = check_team_fits(one_slice, models, 10_000 * GIB, platform="gpu")
    assert on_gpu["solver"].params == alone["solver"].params and on_gpu["verifier"].params == shared["verifier"].params
