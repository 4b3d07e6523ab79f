"""`probe_programs`: this host's real engine and training calls at a config's sizes, and how much each slows the
other, for the calibration (`_emulate_calibration.py`). It builds engines and a trainer from a run config, so it
sits with the benchmarks, above the orchestrator whose views of the config it uses; the host's plain figures
(`emulation/host_probe.py`) stay in the library.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from flexmarl_jax.emulation.chips import Chip
from flexmarl_jax.emulation.host_probe import _REPEATS, ProgramCosts, work_conserving


def probe_programs(config: Any, chip: Chip, *, train_calls: int = 10) -> ProgramCosts:
    """Times the first agent's real engine calls (in the rollout loop) and training micro-batch at `config`'s
    sizes, and how much each slows the other: the run's number of engines (agents x instances per agent, at
    most all devices but one) on XLA devices 0, 1, ..., the trainer on the last device."""
    import jax

    from flexmarl_jax.config.workflow_from_config import team_agents
    from flexmarl_jax.emulation.cost_model import CostModel
    from flexmarl_jax.emulation.roofline import train_step_flops
    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.models import functional
    from flexmarl_jax.models.sources import resolve_model
    from flexmarl_jax.orchestrator.agents import agent_trainer_config
    from flexmarl_jax.orchestrator.rollout_setup import engine_config_for
    from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
    from flexmarl_jax.rollout.instance import EngineInstance
    from flexmarl_jax.rollout.loop import RolloutRequest
    from flexmarl_jax.train.batch import build_micro_batch
    from flexmarl_jax.train.normalizers import IterationNormalizers
    from flexmarl_jax.train.trainer import AgentTrainer

    agent = team_agents(config.workflow)[0]
    source = resolve_model(config.agents[agent].model)
    model = source.model_config
    engine_config = engine_config_for(config, agent)
    devices = jax.devices()
    # As many engines as the run has (one per device, as its layout places them), the trainer on the last device.
    engine_count = max(1, min(len(team_agents(config.workflow)) * config.rollout.instances_per_agent,
                              len(devices) - 1))
    instances = []
    for index in range(engine_count):
        graphdef, params = functional.init_params(model, seed=index)
        params = jax.device_put(params, devices[index])
        engine = FlexEngine(model, graphdef, engine_config, source.tokenizer, params=params,
                            mesh=make_mesh(devices[index:index + 1], fsdp=1))
        instances.append(EngineInstance(engine, params, name=f"calibration-probe{index}"))
    slots, prompt = engine_config.max_concurrent_decodes, config.rollout.max_prompt_length // 2
    steps = config.rollout.max_response_length

    def run_request(instance: EngineInstance, samples: int) -> None:
        """One request of `samples` samples of `steps` tokens through `instance`'s real rollout loop."""
        instance.submit(RolloutRequest(prompt_ids=tuple(range(3, 3 + prompt)), num_samples=samples,
                                       sampling=SlotSampling(temperature=1.0), max_new_tokens=steps,
                                       ignore_eos=True))
        instance.run_until_idle()

    def request_seconds() -> float:
        """Wall seconds of one request of every slot on the first engine alone."""
        started = time.perf_counter()
        run_request(instances[0], slots)
        return time.perf_counter() - started

    def all_engines_seconds() -> float:
        """Wall seconds of one request of every slot on each engine at once (a thread each), as a rollout
        keeps every agent's engines decoding."""
        threads = [threading.Thread(target=run_request, args=(instance, slots), name=instance.name)
                   for instance in instances]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started

    for instance in instances:  # compiles the prefill, insert and decode programs on each engine's device
        run_request(instance, 1)
        run_request(instance, slots)
    # The fastest request, as for the micro-batch below. Medians of 21 calls were tried: they predicted every
    # mode 13-48% high in four calibration runs (an isolated call's typical cost is above a call's inside the
    # run), where the fastest call's predictions were 4-34% off, low and high, in three.
    best = min(request_seconds() for _ in range(_REPEATS))
    # One prefill call and `steps` decode calls, each costing its roofline plus the overhead o on this host:
    # best = prefill roofline + steps x decode roofline + (steps + 1) x o.
    roofline = CostModel(model, dataclasses.replace(chip, call_overhead_s=0.0), mfu=config.pipeline.emulate_mfu)
    rooflines = roofline.prefill_s(1, prompt) + sum(roofline.decode_step_s(slots, prompt + k) for k in range(steps))
    decode_overhead = max(0.0, (best - rooflines) / (steps + 1))

    trainer_config = agent_trainer_config(config, agent)
    # On a device of its own, as a run's trainers are on other fake devices than its engines (same cores).
    trainer = AgentTrainer(agent, model, trainer_config, mesh=make_mesh(devices[-1:], fsdp=1))
    rows, response = config.train.micro_batch_size, config.rollout.max_response_length
    batch = build_micro_batch(
        agent=agent, prompt_ids=[[3] * prompt] * rows, response_ids=[[4] * response] * rows,
        behaviour_logprobs=[[-1.0] * response] * rows, advantages=[1.0] * rows, aggregation="token_mean",
        normalizers=IterationNormalizers.from_response_lengths([response] * rows, norm_length=response),
        batch_size=rows, max_len=trainer_config.max_len)

    def micro_batch_seconds() -> float:
        started = time.perf_counter()
        trainer.accumulate(batch)
        jax.block_until_ready(trainer.accumulated_gradients())
        return time.perf_counter() - started

    micro_batch_seconds()  # compiles
    best_train = min(micro_batch_seconds() for _ in range(train_calls))
    flops = train_step_flops(model, rows, prompt + response)
    mfu = min(1.0, flops / (best_train * chip.peak_bf16_flops))

    engine_slowdown = _slowdown(all_engines_seconds, beside=micro_batch_seconds)
    training_slowdown = _slowdown(micro_batch_seconds, beside=all_engines_seconds)
    trainer.discard_accumulated()
    engine_factor, training_factor = work_conserving(engine_slowdown, training_slowdown)
    return ProgramCosts(decode_call_overhead_s=decode_overhead, train_mfu=mfu, decode_step_s=best / (steps + 1),
                        train_micro_batch_s=best_train, engine_slowdown_beside_training=engine_factor,
                        training_slowdown_beside_engines=training_factor,
                        measured_engine_slowdown=engine_slowdown, measured_training_slowdown=training_slowdown)


def _slowdown(timed: Callable[[], float], *, beside: Callable[[], Any], repeats: int = 20, rounds: int = 2) -> float:
    """The median seconds of `timed` while another thread calls `beside` back to back, over its median seconds
    alone (at least 1). Medians, not minima: contention is what is measured, and the least disturbed call
    would hide it. `rounds` alternations of `repeats` calls alone and `repeats` beside, so that the host's
    speed drifting during the probe weighs on both sides alike."""
    alone, beside_of = [], []
    for _ in range(rounds):
        alone += [timed() for _ in range(repeats)]
        stop = threading.Event()

        def keep_busy(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                beside()

        thread = threading.Thread(target=keep_busy, name="calibration-contention", daemon=True)
        thread.start()
        try:
            beside_of += [timed() for _ in range(repeats)]
        finally:
            stop.set()
            thread.join()
    return max(1.0, statistics.median(beside_of) / statistics.median(alone))
