"""`flexmarl bench emulate`: the headline figures are the stated ratios of the modes' numbers, the presets are
the paper's team shapes built on configs/tiny.py, a small preset runs a mode end to end through the real
orchestrator, and bad input is refused in one line naming the value and the choices."""

import pytest

from flexmarl_benchmarks import emulate
from flexmarl_benchmarks._emulate_presets import (
    CA,
    MA,
    PAPER_WORKLOAD,
    Preset,
    coding_team,
    mixture_team,
)
from flexmarl_jax.config import RunConfig
from flexmarl_jax.configs import tiny


def test_headline_figures_are_the_stated_ratios():
    def mode(e2e, tokens_per_s, utilization=0.5):
        return {"e2e_s": e2e, "tokens_per_s": tokens_per_s, "train_utilization": utilization,
                "host_overhead_within_bound": True}

    figures = emulate.headline({"serial": mode(70.0, 10.0), "sync": mode(20.0, 30.0),
                                "flexmarl": mode(10.0, 100.0, 0.6),
                                "no_async": mode(20.3, 50.0), "no_balancing": mode(12.0, 77.0),
                                "static_allocation": mode(10.0, 100.0, 0.2)})
    assert figures["speedup_vs_serial"] == pytest.approx(7.0)
    assert figures["speedup_vs_sync"] == pytest.approx(2.0)
    assert figures["e2e_increase_without_async"] == pytest.approx(1.03)  # +103%, as the paper writes it
    assert figures["throughput_loss_without_balancing"] == pytest.approx(0.23)
    assert figures["train_utilization"] == 0.6 and figures["train_utilization_static_allocation"] == 0.2
    assert emulate.headline({"flexmarl": mode(10.0, 1.0)})["speedup_vs_serial"] is None  # a mode not run


def calls_per_agent(config: RunConfig) -> dict[str, int]:
    """How often each agent is called per trajectory, from the workflow the config builds."""
    from flexmarl_jax.config.workflow_from_config import workflow_from_config

    counts: dict[str, int] = {}
    for node in workflow_from_config(config.workflow).nodes.values():
        counts[node.agent] = counts.get(node.agent, 0) + 1
    return counts


@pytest.mark.parametrize("preset, agents, chip, model",
                         [(MA, 15, "v5p", "qwen2.5-14b"), (CA, 11, "v5p", "qwen2.5-32b")])
def test_the_presets_are_the_papers_team_shapes(preset, agents, chip, model, tmp_path):
    config = RunConfig.from_config(preset.config_dict(preset.modes()["flexmarl"], seed=0, workdir=str(tmp_path)))
    assert len(config.agents) == agents and config.rollout.instances_per_agent == 4
    assert config.rollout.max_response_length == 8192 and config.pipeline.emulate_median_response == 1024
    assert config.workflow.queries_per_iteration * config.workflow.samples_per_query == 64
    # flexmarl as the paper defines it: on-policy, with Delta = 5 the balancer's queue-gap threshold
    assert config.train.micro_batch_size == 16 and config.train.max_staleness == 0
    assert config.pipeline.balance_delta == 5 and config.pipeline.emulate == f"{chip}:{model}"
    calls = calls_per_agent(config)
    assert set(calls) == set(config.agents) and max(calls.values()) >= 3 and min(calls.values()) == 1  # skewed
    # what the preset does not set keeps configs/tiny.py's value
    assert config.train.learning_rate == RunConfig.from_config(tiny.get_config()).train.learning_rate
    sync = RunConfig.from_config(preset.config_dict(preset.modes()["sync"], seed=0, workdir=str(tmp_path)))
    assert sync.train.max_staleness == 0 and sync.mesh.train_slices == 0  # the baselines: on-policy, dedicated


def test_every_mode_but_the_stale_extension_is_on_policy_and_the_ablations_take_one_feature_away(tmp_path):
    modes = MA.modes()
    assert list(modes) == ["serial", "sync", "flexmarl", "no_async", "no_balancing", "static_allocation",
                           "flexmarl_stale"]
    configs = {mode: RunConfig.from_config(MA.config_dict(overrides, seed=0, workdir=str(tmp_path)))
               for mode, overrides in modes.items()}
    assert {mode for mode, config in configs.items() if config.train.max_staleness > 0} == {"flexmarl_stale"}
    flexmarl = configs["flexmarl"]
    assert flexmarl.pipeline.async_micro_batches and flexmarl.pipeline.balancing and flexmarl.mesh.train_slices > 0

    def differences(mode):
        a, b = flexmarl.to_dict(), configs[mode].to_dict()
        return {f"{section}.{key}" for section in a if isinstance(a[section], dict)
                for key in a[section] if a[section][key] != b[section][key]}

    assert differences("no_async") == {"pipeline.async_micro_batches"}
    assert differences("no_balancing") == {"pipeline.balancing"}
    assert differences("static_allocation") == {"mesh.train_slices"}
    assert differences("flexmarl_stale") == {"train.max_staleness"}


def test_each_presets_slots_are_the_most_whose_kv_cache_fits_at_the_maximum_context(tmp_path):
    from flexmarl_jax.config.errors import ConfigError
    from flexmarl_jax.emulation.chips import get_chip
    from flexmarl_jax.emulation.model_shapes import resolve_model_shape

    for preset, model_name, chips in ((MA, "qwen2.5-14b", 1), (CA, "qwen2.5-32b", 2)):
        config = RunConfig.from_config(preset.config_dict(preset.modes()["flexmarl"], seed=0, workdir=str(tmp_path)))
        model, hbm = resolve_model_shape(model_name), chips * get_chip("v5p").hbm_bytes
        context = config.rollout.max_prompt_length + config.rollout.max_response_length
        kv_per_slot = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2 * context  # K and V, bf16
        weights = model.num_params() * 2
        slots = config.rollout.decode_slots
        assert config.mesh.rollout_devices_per_instance == chips
        assert weights + slots * kv_per_slot <= hbm < weights + (slots + 1) * kv_per_slot, preset.name
        # one slot more is refused by the run config, in one line naming the setting and what fits
        with pytest.raises(ConfigError) as error:
            RunConfig.from_config(preset.config_dict(preset.modes()["flexmarl"], seed=0, workdir=str(tmp_path),
                                                     changes={"rollout.decode_slots": slots + 1}))
        message = str(error.value)
        assert "\n" not in message and f"config.rollout.decode_slots={slots + 1}" in message
        assert f"at most {slots} slots fit" in message
    assert (MA.overrides["rollout.decode_slots"], CA.overrides["rollout.decode_slots"]) == (39, 56)


def test_preset_changes_come_last(tmp_path):
    changed = RunConfig.from_config(MA.config_dict(MA.modes()["serial"], seed=3, workdir=str(tmp_path),
                                                   changes={"rollout.max_response_length": "2048"}))
    assert changed.rollout.max_response_length == 2048 and changed.seed == 3
    assert changed.rollout.decode_slots == MA.overrides["rollout.decode_slots"] < PAPER_WORKLOAD["rollout.decode_slots"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("team", [mixture_team({"proposer0": 2, "proposer1": 1}),
                                  coding_team({"coder0": 2}, {"tester0": 1})])
def test_a_small_preset_runs_a_mode_through_the_orchestrator(team, tmp_path):
    preset = Preset(name="small", team=team, iterations=1, overrides={
        "pipeline.emulate": "v5p:qwen2.5-14b", "rollout.max_response_length": 16,
        "pipeline.emulate_median_response": 4, "rollout.instances_per_agent": 1, "workflow.queries_per_iteration": 1,
        "pipeline.emulate_compression": 20.0})
    overrides = {**preset.modes()["flexmarl"], "mesh.train_slices": 1}
    numbers = emulate.run_mode(preset, "flexmarl", overrides, seed=0, root=str(tmp_path),
                               plots_dir=str(tmp_path / "plots"), gantt_iterations=1)
    assert numbers["e2e_s"] > 0 and numbers["tokens_per_s"] > 0
    assert numbers["e2e_s"] == pytest.approx(numbers["wall_s_per_iteration"] * 20.0)
    assert 0 < numbers["train_utilization"] <= 1 and numbers["host_stall_share"] >= 0
    assert numbers["generate_calls"] > 0 and numbers["decode_steps_per_call"] >= 1
    balancer = numbers["balancer"]
    team = RunConfig.from_config(preset.config_dict(overrides, seed=0, workdir=str(tmp_path))).agents
    assert set(balancer["queue_peak"]) == set(team) and all(peak >= 0 for peak in balancer["queue_peak"].values())
    assert balancer["moves"] >= 0 and balancer["migration_s"] >= 0 and numbers["sync_s"] > 0
    assert numbers["swap_s"] > 0  # three agents take turns on one slice: states move in and out
    # a lower bound: below what the run took, and its critical path a real chain of calls (more than a call)
    assert 0 < numbers["lower_bound_s"] <= numbers["e2e_s"]
    parts = numbers["lower_bound_parts_s"]
    assert numbers["lower_bound_s"] >= parts["critical_path_s"] + parts["tail_s"] - 1e-9 and parts["training_s"] > 0
    tokens = numbers["train_tokens"]
    assert 0 < tokens["real"] <= tokens["padded"]  # padding to the longest row of a micro-batch adds, never drops
    assert (tmp_path / "plots" / "small" / "flexmarl" / "gantt.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--set", "agents"], "--set 'agents': expected KEY=VALUE"),
    (["--set", "rollout.nonsense=3"], "unknown config key 'rollout.nonsense'"),
    (["--presets", "XX"], "--presets: unknown preset(s) ['XX']; choices: MA, CA"),
    (["--modes", "fast"], "--modes: unknown mode(s) ['fast']; choices: serial, sync, flexmarl, no_async"),
    (["--emulate", "tpu9:qwen2.5-14b"], "unknown chip 'tpu9'; choices: h100, h200, v5e, v5p, v6e"),
    (["--emulate", "v5p:llama-9000"], "unknown model 'llama-9000'; choices: a preset (qwen2.5-0.5b"),
    (["--set", "pipeline.emulate_mfu=1.5"], "config.pipeline.emulate_mfu=1.5 is outside (0, 1]"),
    (["--set", "pipeline.emulate_mfu=0"], "config.pipeline.emulate_mfu=0.0 is outside (0, 1]"),
    (["--set", "pipeline.emulate_compression=0.5"], "config.pipeline.emulate_compression=0.5 must be >= 1"),
    (["--gantt-iterations", "-1"], "--gantt-iterations=-1 must be >= 0"),
])
def test_bad_input_is_one_line_naming_the_value_and_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        emulate.parse_args(["--presets", "MA", *argv] if "--presets" not in argv else argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error, error


def test_emulate_and_set_reach_every_preset():
    args = emulate.parse_args(["--emulate", "h200:qwen2.5-32b", "--set", "rollout.max_response_length=1024"])
    assert args.changes == {"rollout.max_response_length": "1024", "pipeline.emulate": "h200:qwen2.5-32b"}
    assert args.presets == "MA,CA"


def test_the_calibration_statistic_leaves_out_iterations_that_compiled():
    from flexmarl_benchmarks._steady import steady_median

    # Iterations 2 and 5 met a new shape: most of their seconds are JAX compiling.
    seconds = [0.50, 14.0, 0.60, 0.55, 4.4, 0.58, 0.52]
    compiles = [0.0, 13.2, 0.01, 0.0, 3.9, 0.0, 0.0]
    assert steady_median(seconds, compiles) == (0.55, 5)
    # Fewer than three steady iterations: the median of all, and the count says so.
    assert steady_median([1.0, 9.0, 2.0], [0.0, 8.0, 1.5]) == (2.0, 1)


def test_the_calibration_takes_each_probe_figure_as_the_median_of_its_rounds():
    import dataclasses

    from flexmarl_benchmarks._emulate_calibration import median_probe
    from flexmarl_jax.emulation.chips import Chip
    from flexmarl_jax.emulation.host_probe import ProgramCosts

    def probe(flops: float, overhead: float, mfu: float, engine: float) -> tuple[Chip, ProgramCosts]:
        chip = Chip(name="host", title="t", peak_bf16_flops=flops, hbm_bytes_per_s=2 * flops, hbm_bytes=1.0,
                    interconnect="host", interconnect_bytes_per_s=3 * flops, source="s", call_overhead_s=overhead,
                    one_device=True)
        return chip, ProgramCosts(decode_call_overhead_s=overhead, train_mfu=mfu, decode_step_s=2 * overhead,
                                  train_micro_batch_s=0.02, engine_slowdown_beside_training=engine,
                                  training_slowdown_beside_engines=2 * engine)

    # achieved training FLOP/s (mfu x flops): 40, 15, 18 -> 18; at the median 100 FLOP/s, an MFU of 0.18 (the
    # MFUs' own median, 0.3, would pair with another probe's FLOP/s)
    chip, costs = median_probe([probe(100.0, 1e-3, 0.4, 1.5), probe(150.0, 3e-3, 0.1, 1.2),
                                probe(60.0, 2e-3, 0.3, 1.3)])
    assert (chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.interconnect_bytes_per_s) == (100.0, 200.0, 300.0)
    assert chip.call_overhead_s == 2e-3 and chip.one_device
    assert costs.decode_call_overhead_s == 2e-3 and costs.decode_step_s == 4e-3
    assert (costs.engine_slowdown_beside_training, costs.training_slowdown_beside_engines) == (1.3, 2.6)
    assert costs.train_mfu == pytest.approx(0.18)
    one = probe(100.0, 1e-3, 0.5, 1.5)
    assert median_probe([one]) == (one[0], dataclasses.replace(one[1], train_mfu=pytest.approx(0.5)))


def test_the_lower_bound_is_the_longest_chain_of_calls_costed_alone_then_what_cannot_overlap_it():
    """And the training, which starts no earlier than the first query's whole group is done."""
    from flexmarl_benchmarks._lower_bound import critical_path, decode_call_s, first_group_s, iteration_lower_bound
    from flexmarl_jax.emulation.chips import get_chip
    from flexmarl_jax.models.presets import get_preset
    from flexmarl_jax.workflows.graph import Edge, Node, Workflow, first_answer_of
    from tests.settings_views import cost_model

    model = cost_model(get_preset("qwen2.5-14b"), get_chip("v5p"), chips=1)
    # A call of 300 steps from 100 positions: at least 300 steps at the first context, at most their exact sum,
    # which the convexity bound (300 steps at the mean context) may not exceed.
    exact = model.prefill_s(1, 100) + model.decode_steps_s(1, 100, 300)
    assert model.prefill_s(1, 100) + 300 * model.decode_step_s(1, 100) <= decode_call_s(model, 100, 300) <= exact
    # plan -> (a, b) -> review; two trajectories of one query: the second's chain through b is the longest.
    workflow = Workflow("dag", [Node("plan", "plan"), Node("a", "a"), Node("b", "b"), Node("review", "review")],
                        [Edge("plan", "a"), Edge("plan", "b"), Edge("a", "review"), Edge("b", "review")],
                        first_answer_of(["review"]))
    turn = workflow.turn
    calls = [("plan", "q", turn["plan"], [(10, 50), (10, 20)]), ("a", "q", turn["a"], [(60, 100), (30, 10)]),
             ("b", "q", turn["b"], [(60, 10), (30, 400)]), ("review", "q", turn["review"], [(200, 5), (500, 30)])]
    seconds, agent, length = critical_path(calls, workflow, model)
    first = decode_call_s(model, 10, 50) + decode_call_s(model, 60, 100) + decode_call_s(model, 200, 5)
    second = decode_call_s(model, 10, 20) + decode_call_s(model, 30, 400) + decode_call_s(model, 500, 30)
    assert seconds == pytest.approx(max(first, second)) and second > first and (agent, length) == ("review", 530)
    # A second query, one short trajectory: its group is complete first, and no training starts before.
    short = [("plan", "r", turn["plan"], [(10, 5)]), ("a", "r", turn["a"], [(20, 5)]),
             ("b", "r", turn["b"], [(20, 8)]), ("review", "r", turn["review"], [(40, 5)])]
    first_group = decode_call_s(model, 10, 5) + decode_call_s(model, 20, 8) + decode_call_s(model, 40, 5)
    assert first_group_s(calls + short, workflow, model) == pytest.approx(first_group) and first_group < first
    bound = iteration_lower_bound(calls + short, workflow, rollout=model, train=model, sync_s=0.5,
                                  micro_batch_s={"plan": [1.0], "a": [2.0, 2.0], "b": [3.0], "review": [1.0]},
                                  meshes=2)
    assert bound["tail_s"] == pytest.approx(model.train_micro_batch_s(1, 530) + model.optimizer_apply_s() + 0.5)
    # training: after the first group, 9 s of micro-batches over 2 meshes (4.5 s), no agent under its own 4 s,
    # then an update and a sync
    assert bound["first_group_s"] == pytest.approx(first_group)
    assert bound["training_s"] == pytest.approx(first_group + 4.5 + model.optimizer_apply_s() + 0.5)
    stale = iteration_lower_bound(calls + short, workflow, rollout=model, train=model, sync_s=0.5,
                                  micro_batch_s={"a": [2.0]}, meshes=1, on_policy=False)
    assert stale["first_group_s"] == 0.0 and stale["training_s"] == pytest.approx(2.0 + model.optimizer_apply_s() + 0.5)
    assert bound["lower_bound_s"] == max(bound["critical_path_s"] + bound["tail_s"], bound["training_s"])
