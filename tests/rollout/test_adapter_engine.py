"""One FlexEngine serving several LoRA agents of one base (`AdaptedParams`): every prompt and decode slot carries
its own adapter, so a batch of mixed agents decodes exactly as each agent's adapter alone would, and one agent's
adapter is replaced while the others' sequences decode, without a recompile."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from flexmarl_jax.models import lora
from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from tests.settings_views import engine_config, lora_spec

from .conftest import prompts_of_mixed_lengths

# Three agents of one base: different ranks, scales and targets (the table pads them to rank 8).
SPECS = (lora_spec(rank=4, alpha=8.0), lora_spec(rank=8, alpha=4.0), lora_spec(rank=2, alpha=4.0,
                                                                              targets=("q_proj", "v_proj")))
MAX_NEW = 12


def _trained_adapter(config, spec, seed: int, size: float = 0.3) -> dict:
    """An adapter with nonzero B, as after training (a new one, B = 0, would be the base exactly)."""
    adapter = lora.init_adapters(config, spec, seed=seed)
    key = jax.random.key(500 + seed)
    return {target: {"a": pair["a"], "b": size * jax.random.normal(jax.random.fold_in(key, i), pair["b"].shape)}
            for i, (target, pair) in enumerate(sorted(adapter.items()))}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return [_trained_adapter(tiny_model.config, spec, seed) for seed, spec in enumerate(SPECS)]


def _engine(tiny_model, params) -> FlexEngine:
    config = engine_config(max_concurrent_decodes=8, max_prefill_length=32, max_decode_length=24,
                           prefill_buckets=(16, 32), prefill_batch_sizes=(1, 4))
    return FlexEngine(tiny_model.config, tiny_model.graphdef, config, tiny_model.tokenizer, params=params)


def _table(tiny_model, adapters, specs, rank=None) -> lora.AdaptedParams:
    return lora.AdaptedParams(tiny_model.params, lora.adapter_table(adapters, specs, rank=rank))


@pytest.fixture(scope="module")
def mixed_engine(tiny_model, adapters):
    params = _table(tiny_model, adapters, SPECS)
    engine = _engine(tiny_model, params)
    engine.warm_up(params)
    return engine


def _requests(prompts, sampling, *, ignore_eos=False):
    return [RolloutRequest(prompt_ids=prompt, num_samples=2, sampling=sampling, max_new_tokens=MAX_NEW,
                           ignore_eos=ignore_eos) for prompt in prompts]


def _generate(engine, params, prompts, rows, sampling, **kwargs):
    """Every prompt's samples, each prompt decoding with its row of the adapter table."""
    return RolloutLoop(engine, params).generate(_requests(prompts, sampling, **kwargs), rows)


def _outputs(results) -> list[tuple[tuple[int, ...], np.ndarray]]:
    return [(sample.token_ids, np.asarray(sample.logprobs)) for samples in results for sample in samples]


@pytest.mark.parametrize("sampling", [SlotSampling(), SlotSampling(temperature=1.0, top_k=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_batch_of_mixed_agents_decodes_as_each_agent_alone(tiny_model, adapters, mixed_engine, sampling):
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 9, seed=4)
    rows = [index % len(SPECS) for index in range(len(prompts))]
    mixed = _outputs(_generate(mixed_engine, mixed_engine.load_params(), prompts, rows, sampling))
    alone = [None] * len(prompts)
    for row, (adapter, spec) in enumerate(zip(adapters, SPECS, strict=True)):
        params = _table(tiny_model, [adapter], [spec])  # a table of one: this agent's adapter only
        mine = [index for index in range(len(prompts)) if rows[index] == row]
        results = _generate(_engine(tiny_model, params), params, [prompts[index] for index in mine], None, sampling)
        for index, samples in zip(mine, results, strict=True):
            alone[index] = samples
    expected = _outputs(alone)
    assert [tokens for tokens, _ in mixed] == [tokens for tokens, _ in expected]
    assert max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in zip(mixed, expected, strict=True)) < 1e-5
    # and the agents really differ: the same prompt under each adapter gives three different continuations
    by_agent = _outputs(_generate(mixed_engine, mixed_engine.load_params(), [prompts[0]] * len(SPECS),
                                  list(range(len(SPECS))), SlotSampling()))
    assert len({tokens for tokens, _ in by_agent[::2]}) == len(SPECS)


def test_an_adapter_equals_its_merged_weights_in_the_engine(tiny_model, adapters, mixed_engine):
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 4, seed=5)
    mixed = _outputs(_generate(mixed_engine, mixed_engine.load_params(), prompts, [1] * len(prompts),
                               SlotSampling()))
    merged = lora.merge_adapter(tiny_model.params, adapters[1], SPECS[1])
    plain = _outputs(_generate(_engine(tiny_model, merged), merged, prompts, None, SlotSampling()))
    assert [tokens for tokens, _ in mixed] == [tokens for tokens, _ in plain]
    assert max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in zip(mixed, plain, strict=True)) < 1e-4


def test_one_agents_new_adapter_goes_in_while_the_others_decode(tiny_model, adapters):
    """Rows 0 and 1 decode; a new version of agent 1 goes into its spare row 2 meanwhile (row 1 is busy and
    refused). Row 0's and row 1's sequences finish exactly as they would have without the swap, under their own
    versions, and a request that names row 2 afterwards decodes with the new adapter and reports its version.
    Nothing recompiles."""
    spare = lora.init_adapters(tiny_model.config, SPECS[1], seed=9)  # B = 0 until the first version
    params = _table(tiny_model, [adapters[0], adapters[1], spare], [SPECS[0], SPECS[1], SPECS[1]])
    engine = _engine(tiny_model, params)
    engine.warm_up(params)
    loop = RolloutLoop(engine, params, policy_version=4)
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 4, seed=6)
    sampling = SlotSampling(temperature=1.0, seed=11)
    # The same table on a fresh engine, never swapped: the same shapes, so the same arithmetic (a table of other
    # shapes would sum in another order, ~1e-5 apart at temperature 1).
    same = _table(tiny_model, [adapters[0], adapters[1], spare], [SPECS[0], SPECS[1], SPECS[1]])
    reference = _outputs(_generate(_engine(tiny_model, same), same, prompts, [0, 1, 0, 1], sampling,
                                   ignore_eos=True))
    compiled = engine.compiled_cache_sizes()

    done = []
    for request, row in zip(_requests(prompts, sampling, ignore_eos=True), [0, 1, 0, 1], strict=True):
        loop.submit(dataclasses.replace(request, on_done=done.append), row)
    for _ in range(3):
        loop.step()
    assert loop.active_slots == 8
    new_version = _trained_adapter(tiny_model.config, SPECS[1], seed=21)
    with pytest.raises(RuntimeError, match=r"set_adapter\(1\) while 4 sequences decode with that row"):
        loop.set_adapter(1, new_version, SPECS[1], policy_version=5)
    loop.set_adapter(2, new_version, SPECS[1], policy_version=5)
    loop.run_until_idle()
    finished = sorted(done, key=lambda samples: prompts.index(samples[0].prompt_ids))
    assert [tokens for tokens, _ in _outputs(finished)] == [tokens for tokens, _ in reference]
    assert max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in zip(_outputs(finished), reference,
                                                                      strict=True)) < 1e-6
    assert {sample.policy_version for samples in finished for sample in samples} == {4}

    after = loop.generate(_requests(prompts[:2], SlotSampling()), [2, 2])
    assert {sample.policy_version for samples in after for sample in samples} == {5}
    new_alone = _table(tiny_model, [new_version], [SPECS[1]])
    expected = _generate(_engine(tiny_model, new_alone), new_alone, prompts[:2], None, SlotSampling())
    assert [tokens for tokens, _ in _outputs(after)] == [tokens for tokens, _ in _outputs(expected)]
    assert engine.compiled_cache_sizes() == compiled
    assert engine._write_adapter_jit._cache_size() == 1


def test_bad_adapter_rows_and_replacements_are_refused(tiny_model, adapters, mixed_engine):
    params = mixed_engine.load_params()
    padded = np.zeros((1, 16), np.int32)
    with pytest.raises(ValueError, match=r"adapters \[3\] must be 1 indices in \[0, 3\)"):
        mixed_engine.prefill_batch(params, padded, [3], [None], [3])
    with pytest.raises(ValueError, match="the params have no adapter table"):
        _engine(tiny_model, tiny_model.params).prefill_batch(tiny_model.params, padded, [3], [None], [1])
    with pytest.raises(ValueError, match="must be an int >= 0"):
        RolloutLoop(mixed_engine, params).submit(RolloutRequest(prompt_ids=(1, 2)), adapter=-1)
    small = _table(tiny_model, adapters[:1], SPECS[:1])  # rank 4, every target
    engine = _engine(tiny_model, small)
    with pytest.raises(ValueError, match="an adapter of rank 8 does not fit a table of rank 4"):
        engine.replace_adapter(small, 0, adapters[1], SPECS[1])
    with pytest.raises(ValueError, match="outside the table's 1 adapters"):
        engine.replace_adapter(small, 1, adapters[0], SPECS[0])
    with pytest.raises(TypeError, match="needs AdaptedParams"):
        engine.replace_adapter(tiny_model.params, 0, adapters[0], SPECS[0])
    narrow = _table(tiny_model, adapters[2:], SPECS[2:], rank=8)  # q and v only, room for rank 8
    with pytest.raises(ValueError, match=r"has targets \['down_proj'"):
        engine.replace_adapter(narrow, 0, adapters[0], SPECS[0])
    with pytest.raises(ValueError, match="table rank 2 is below its largest adapter's rank 8"):
        lora.adapter_table(adapters[:2], SPECS[:2], rank=2)


def test_an_instance_serves_two_agents_and_syncs_one_adapter_without_draining(tiny_model, adapters):
    """Agents "a" and "b" on one instance (a current and a spare row each). While both decode, b's next version
    is synced alone: b's running sequences and all of a's finish as if nothing happened (same tokens, their
    versions), none was re-queued, and b's next requests decode with the new adapter under its new version."""
    from flexmarl_jax.rollout.instance import EngineInstance

    spare = lora.init_adapters(tiny_model.config, SPECS[1], seed=9)
    rows = [adapters[0], spare, adapters[1], spare]  # a: rows 0 (current) and 1; b: rows 2 (current) and 3
    specs = [SPECS[0], SPECS[1], SPECS[1], SPECS[1]]
    params = lora.AdaptedParams(tiny_model.params, lora.adapter_table(rows, specs))
    engine = _engine(tiny_model, params)
    engine.warm_up(params)
    instance = EngineInstance(engine, params, adapter_agents=("a", "b"), name="group")
    assert instance.adapter_agents == ("a", "b")
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 4, seed=7)
    sampling = SlotSampling(temperature=1.0, seed=5)
    two = _table(tiny_model, adapters[:2], SPECS[:2])
    reference = _outputs(_generate(_engine(tiny_model, two), two, prompts, [0, 1, 0, 1], sampling, ignore_eos=True))

    done = []
    agents = ["a", "b", "a", "b"]
    for request, agent in zip(_requests(prompts, sampling, ignore_eos=True), agents, strict=True):
        instance.submit(dataclasses.replace(request, agent=agent, on_done=done.append))
    for _ in range(3):
        instance.step()
    new_version = _trained_adapter(tiny_model.config, SPECS[1], seed=21)
    instance.update_adapter("b", new_version, SPECS[1], version=7)
    instance.step()  # the boundary that applies it: b's old sequences are on row 2, the new version goes to row 3
    assert instance.swaps == 1 and instance.adapter_versions == {"b": 7}
    assert instance.load().active_slots == 8  # nothing drained or re-queued
    instance.run_until_idle()
    finished = sorted(done, key=lambda samples: prompts.index(samples[0].prompt_ids))
    assert [tokens for tokens, _ in _outputs(finished)] == [tokens for tokens, _ in reference]
    assert {sample.policy_version for samples in finished for sample in samples} == {0}

    after = []
    for request in _requests(prompts[:2], SlotSampling()):
        instance.submit(dataclasses.replace(request, agent="b", on_done=after.append))
    instance.run_until_idle()
    after = sorted(after, key=lambda samples: prompts.index(samples[0].prompt_ids))
    assert {sample.policy_version for samples in after for sample in samples} == {7}
    new_alone = _table(tiny_model, [new_version], [SPECS[1]])
    expected = _generate(_engine(tiny_model, new_alone), new_alone, prompts[:2], None, SlotSampling())
    assert [tokens for tokens, _ in _outputs(after)] == [tokens for tokens, _ in _outputs(expected)]

    with pytest.raises(ValueError, match=r"agent 'c' has no adapter on this engine; it serves \['a', 'b'\]"):
        instance.submit(RolloutRequest(prompt_ids=prompts[0], agent="c"))
    with pytest.raises(ValueError, match="agent 'c' has no adapter"):
        instance.update_adapter("c", new_version, SPECS[1], version=8)
    with pytest.raises(ValueError, match="2 adapter agents need AdaptedParams with a table of 4 rows"):
        EngineInstance(engine, _table(tiny_model, adapters[:2], SPECS[:2]), adapter_agents=("a", "b"))
    plain = EngineInstance(_engine(tiny_model, tiny_model.params), tiny_model.params)
    with pytest.raises(ValueError, match="serves no adapter table"):
        plain.update_adapter("a", new_version, SPECS[1], version=1)
