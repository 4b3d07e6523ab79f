"""EngineInstance: load figures, weight hot-swap without recompiles or mixed versions, threads."""

from __future__ import annotations

import jax
import pytest

from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutRequest

from .conftest import TinyModel, make_tiny_model, prompts_of_mixed_lengths
from .test_engine import greedy_reference


@pytest.fixture(scope="module")
def new_model(tiny_model) -> TinyModel:
    other = make_tiny_model(seed=1)
    return TinyModel(tiny_model.config, tiny_model.graphdef, other.params, tiny_model.tokenizer)


def test_load_figures_track_queue_and_slots(engine, tiny_model):
    instance = EngineInstance(engine, tiny_model.params)
    prompt = tuple(tiny_model.tokenizer.encode("load"))
    for _ in range(3):
        instance.submit(RolloutRequest(prompt, num_samples=4, max_new_tokens=5))
    load = instance.load()
    assert (load.queued_requests, load.active_slots, load.outstanding_tokens, load.free_slots) == (3, 0, 60, 8)
    instance.step()
    load = instance.load()
    # 8 slots: two requests fully admitted, the third still waits; one token generated per slot is in flight
    assert (load.queued_requests, load.active_slots, load.free_slots) == (1, 8, 0)
    assert load.outstanding_tokens == 60
    instance.run_until_idle()
    load = instance.load()
    assert (load.queued_requests, load.active_slots, load.outstanding_tokens) == (0, 0, 0)
    assert instance.generated_tokens == 60


@pytest.mark.parametrize("swap_policy", ["drain", "requeue"])
def test_update_params_never_mixes_versions_and_never_recompiles(engine, tiny_model, new_model, swap_policy):
    engine.warm_up(tiny_model.params)
    instance = EngineInstance(engine, tiny_model.params, swap_policy=swap_policy)
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 8, seed=21)
    results = {}

    def submit(index):
        def done(samples):
            results[index] = samples[0]
        instance.submit(RolloutRequest(prompts[index], max_new_tokens=12, on_done=done))

    for index in range(4):
        submit(index)
    for _ in range(3):
        instance.step()
    assert not results  # the first four are mid-sequence when the new weights arrive
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        instance.update_params(new_model.params, version=1)
        for index in range(4, 8):
            submit(index)
        instance.run_until_idle()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert instance.policy_version == 1 and instance.swaps == 1
    models = {0: tiny_model, 1: new_model}
    expected_first_version = 0 if swap_policy == "drain" else 1
    for index, result in results.items():
        assert result.policy_version == (expected_first_version if index < 4 else 1)
        want = greedy_reference(models[result.policy_version], prompts[index], 12, tiny_model.tokenizer.eos_id)
        assert list(result.token_ids) == want, f"request {index} mixes versions"
    assert len(results) == 8


def test_update_params_rejects_a_different_model(engine, tiny_model):
    instance = EngineInstance(engine, tiny_model.params)
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim else x, tiny_model.params)
    with pytest.raises(ValueError, match="hot-swap needs the same model"):
        instance.update_params(wrong, version=1)


@pytest.mark.timeout(60)
def test_threaded_instances_make_progress_together(engine, tiny_model):
    instances = [EngineInstance(engine, tiny_model.params, name=f"i{k}") for k in range(2)]
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 10, seed=4)
    done = {}
    import threading

    finished = threading.Event()

    def callback(index):
        def on_done(samples):
            done[index] = samples[0]
            if len(done) == len(prompts):
                finished.set()
        return on_done

    for instance in instances:
        instance.start()
    try:
        for index, prompt in enumerate(prompts):
            instances[index % 2].submit(RolloutRequest(prompt, max_new_tokens=6, on_done=callback(index)))
        assert finished.wait(50)
    finally:
        for instance in instances:
            instance.stop()
    assert all(instance.generated_tokens > 0 for instance in instances)
    for index, prompt in enumerate(prompts):
        assert list(done[index].token_ids) == greedy_reference(tiny_model, prompt, 6, tiny_model.tokenizer.eos_id)


def test_instance_on_a_tensor_parallel_sub_mesh_matches_full_forward(tiny_model):
    from flexmarl_jax.mesh.meshes import make_mesh
    from tests.settings_views import engine_config

    mesh = make_mesh(jax.devices()[2:4], fsdp=1, tp=2)
    config = engine_config(max_concurrent_decodes=4, max_prefill_length=32, max_decode_length=8, prefill_buckets=(32,))
    instance = EngineInstance.create(tiny_model.config, tiny_model.graphdef, tiny_model.params, config,
                                     tiny_model.tokenizer, mesh=mesh)
    assert {d.id for d in instance.engine.init_decode_state().cache["k"].sharding.device_set} == {2, 3}
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 3, seed=8)
    results = {}
    for index, prompt in enumerate(prompts):
        instance.submit(RolloutRequest(prompt, max_new_tokens=8, on_done=lambda r, i=index: results.setdefault(i, r)))
    instance.run_until_idle()
    for index, prompt in enumerate(prompts):
        want = greedy_reference(tiny_model, prompt, 8, tiny_model.tokenizer.eos_id)
        assert list(results[index][0].token_ids) == want


def test_cancel_frees_slots_and_never_calls_back(engine, tiny_model):
    instance = EngineInstance(engine, tiny_model.params)
    prompt = tuple(tiny_model.tokenizer.encode("cancel me"))
    called = []
    decoding = RolloutRequest(prompt, num_samples=6, max_new_tokens=20, on_done=called.append)
    queued = RolloutRequest(prompt, num_samples=4, max_new_tokens=20, on_done=called.append)
    kept = RolloutRequest(prompt, num_samples=2, max_new_tokens=5, on_done=called.append)
    for request in (decoding, queued, kept):
        instance.submit(request)
    instance.step()
    assert instance.load().active_slots == 8  # 6 of `decoding`, 2 of `queued`
    assert instance.cancel(decoding) and instance.cancel(queued)
    assert not instance.cancel(queued)  # already gone
    assert instance.load().active_slots == 0 and instance.load().queued_requests == 1
    instance.run_until_idle()
    assert len(called) == 1 and len(called[0]) == 2  # only `kept` completed
    assert not instance.cancel(kept)
