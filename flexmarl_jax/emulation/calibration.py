"""Measuring the host's own cost per emulated engine step (the cost model's `host_overhead_s`).

The real `EngineInstance` and `RolloutLoop` run over an `EmulatedEngine` whose device takes no time to
speak of (an enormous compression), with every slot busy for `steps` steps: the wall time per step is then
the host's work alone — admission, bookkeeping, result processing, the scripted tokens. An emulated run is
faithful while this stays well under its compressed step (`TimeScale.overhead_within_bound`).
"""

from __future__ import annotations

import time
from typing import Any

from flexmarl_jax.emulation.chips import get_chip
from flexmarl_jax.emulation.cost_model import CostModel
from flexmarl_jax.emulation.engine import EmulatedEngine, ScriptedTokens, fixed_length, placeholder_params
from flexmarl_jax.emulation.timescale import TimeScale
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutRequest
from flexmarl_jax.rollout.settings import EngineConfig

_NO_DEVICE_TIME = TimeScale(1e15)  # a 10 ms device step lasts 1e-17 s


def measure_host_overhead_s(engine_config: EngineConfig, tokenizer: Any, *, steps: int = 200,
                            prompt_length: int = 8) -> float:
    """Mean wall seconds per step of an instance whose slots all decode for `steps` steps (after a warm-up
    request of one sample, so first-call costs are not counted)."""
    if steps < 1 or not 1 <= prompt_length <= engine_config.max_prefill_length:
        raise ValueError(f"steps={steps} must be >= 1 and prompt_length={prompt_length} in "
                         f"[1, {engine_config.max_prefill_length}]")
    filler = tokenizer.encode("a", add_bos=False)[-1]
    # One decode step per call, as a real engine; the cost model's mfu is never read (an engine's calls never train).
    engine = EmulatedEngine(CostModel(get_preset("tiny"), get_chip("v5e"), mfu=1.0), engine_config, tokenizer,
                            ScriptedTokens(tokenizer.eos_id, filler, fixed_length(steps)), tokens_per_call=1,
                            timescale=_NO_DEVICE_TIME)
    instance = EngineInstance(engine, placeholder_params(), name="calibration")
    prompt = tuple(range(3, 3 + prompt_length))

    def run(samples: int) -> tuple[float, int]:
        before = instance.decode_steps
        instance.submit(RolloutRequest(prompt_ids=prompt, num_samples=samples, sampling=SlotSampling(),
                                       max_new_tokens=steps))
        started = time.perf_counter()
        instance.run_until_idle()
        return time.perf_counter() - started, instance.decode_steps - before

    run(1)  # warm-up
    wall, count = run(engine_config.max_concurrent_decodes)
    return wall / count
