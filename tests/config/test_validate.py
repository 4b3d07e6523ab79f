"""Building the typed config checks every field: one line naming the field, the value and the rule."""

import importlib
import pathlib

import ml_collections
import pytest

from flexmarl_jax.config import ConfigError, RunConfig, apply_overrides, check_devices, devices_needed, load_config


def _build(spec=None, overrides=None, devices=8) -> RunConfig:
    config = RunConfig.from_config(apply_overrides(load_config(spec), overrides or {}))
    check_devices(config, devices)
    return config


@pytest.mark.parametrize("overrides, fragment", [
    ({"train.micro_batch_size": "-1"}, "config.train.micro_batch_size=-1 must be a positive integer"),
    ({"train.micro_batch_size": "48"}, "micro_batch_size=48 must divide train.global_batch_size=128"),
    ({"train.micro_batch_size": "4"}, "must be a multiple of the GRPO group size"),
    ({"rollout.decode_slots": "0"}, "rollout.decode_slots=0 must be a positive integer"),
    ({"pipeline.mode": "turbo"}, "pipeline.mode='turbo' is not allowed; choose one of: serial, sync, flexmarl"),
    ({"train.algorithm": "sft"}, "train.algorithm='sft' is not allowed"),
    ({"agents.solver.temperature": "0"}, "agents.solver.temperature=0.0 must be > 0"),
    ({"agents.verifier.top_p": "1.5"}, "agents.verifier.top_p=1.5 must be in (0, 1]"),
    ({"agents.solver.stop_pattern": "The answer is ("},
     "agents.solver.stop_pattern='The answer is (' is not a valid regular expression"),
    ({"agents.solver.model": "gpt-9"}, "agents.solver.model='gpt-9' is neither a model preset"),
    ({"mesh.tp": "2"}, "mesh.tp=2 must divide mesh.train_devices_per_agent=1"),
    ({"train.max_staleness": "-2"}, "max_staleness=-2 must be >= 0"),
    ({"train.max_staleness": "1", "train.tis_cap": "0.5"}, "config.train.tis_cap=0.5 must be >= 1"),
    ({"pipeline.deterministic": "true", "train.max_staleness": "1"},
     "config.pipeline.deterministic=True needs train.max_staleness=0, got 1"),
    ({"eval.every": "0"}, "config.eval.every=0 must be >= 1"),
    ({"eval.problems": "0"}, "config.eval.problems=0 must be a positive integer"),
    ({"eval.fraction": "1.0"}, "config.eval.fraction=1.0 must be in [0, 1)"),
    ({"workflow.warmup": "rl"}, "config.workflow.warmup='rl' is not allowed; choose one of: format, sft"),
    ({"pipeline.balance_delta": "0"}, "config.pipeline.balance_delta=0 must be a positive integer"),
    ({"rollout.min_instances_per_agent": "2"}, "min_instances_per_agent=2 exceeds rollout.instances_per_agent=1"),
    ({"rollout.max_retries": "-1"}, "config.rollout.max_retries=-1 must be >= 0"),
    ({"agents.solver.lora.rank": "-1"}, "config.agents.solver.lora.rank=-1 must be >= 0"),
    ({"agents.solver.lora.rank": "8", "agents.solver.lora.targets": "q_proj,c_attn"},
     "config.agents.solver.lora.targets='q_proj,c_attn' names c_attn, which the Qwen2, Llama and Qwen3 decoders lack"),
    ({"agents.solver.lora.targets": "q_proj,,v_proj"}, "lora.targets='q_proj,,v_proj' has an empty name"),
    ({"agents.solver.lora.alpha": "0"}, "config.agents.solver.lora.alpha=0.0 must be > 0"),
    ({"agents.solver.lora.rank": "8", "agents.verifier.lora.rank": "4", "agents.verifier.dtype": "bfloat16"},
     "config.agents.verifier.dtype='bfloat16' differs from agents.solver.dtype='float32': LoRA agents of model "
     "'tiny' share one frozen base"),
])
def test_bad_values(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _build(overrides=overrides)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_mesh_larger_than_the_machine():
    config = RunConfig.from_config(apply_overrides(load_config(), {"mesh.train_devices_per_agent": "20"}))
    assert devices_needed(config) == 3 * (1 * 1 + 20)
    with pytest.raises(ConfigError, match=r"config.mesh needs 63 devices .* but 8 exist"):
        check_devices(config, 8)
    check_devices(config, 64)  # the same config fits a bigger machine


def test_a_lora_base_group_binds_its_rollout_devices_once():
    """Solver and verifier as adapters on one model take one agent's rollout instances (2 x 2 devices) between them;
    the corrector its own; each agent its own training device."""
    overrides = {"rollout.instances_per_agent": "2", "mesh.rollout_devices_per_instance": "2",
                 "agents.solver.lora.rank": "8", "agents.verifier.lora.rank": "4"}
    config = RunConfig.from_config(apply_overrides(load_config(), overrides))
    assert devices_needed(config) == 2 * (2 * 2) + 3 * 1
    with pytest.raises(ConfigError, match=r"needs 11 devices \(2 agents x 2 instances x 2 \+ 3 agents x "
                                          r"mesh.train_devices_per_agent=1 \(LoRA base groups counted once\)\) but 8"):
        check_devices(config, 8)
    check_devices(RunConfig.from_config(apply_overrides(load_config(), {
        **overrides, "agents.corrector.lora.rank": "2", "rollout.instances_per_agent": "1"})), 8)


def test_unknown_and_mistyped_fields_in_a_config_file():
    config = load_config()
    with config.unlocked():
        config.train.nonsense = 1
    with pytest.raises(ConfigError, match="unknown config key 'train.nonsense'"):
        RunConfig.from_config(config)
    config = load_config()
    config.agents.solver = ml_collections.ConfigDict({"model": "tiny"})
    with pytest.raises(ConfigError, match="missing config key 'agents.solver.temperature'"):
        RunConfig.from_config(config)
    config = load_config()
    with config.ignore_type():
        config.train.micro_batch_size = "32"
    with pytest.raises(ConfigError, match="config.train.micro_batch_size='32' has type str; expected int"):
        RunConfig.from_config(config)


CONFIG_FILES = sorted(path.name for path in pathlib.Path("configs").glob("*.py") if path.name != "__init__.py")


@pytest.fixture
def recipe_checkpoints(tmp_path, monkeypatch):
    """configs/gsm8k_chain.py and configs/smollm2_team.py name real checkpoints under $FLEXMARL_CHECKPOINTS and
    GSM8K under $FLEXMARL_DATA: stand synthetic checkpoints of the same architecture and the smoke file in for
    them."""
    import shutil

    from flexmarl_jax.models.fixture_cache import synthetic_checkpoint

    for name, size in (("Qwen2.5-1.5B-Instruct", "small"), ("Qwen2.5-0.5B-Instruct", "smoke")):
        (tmp_path / name).symlink_to(synthetic_checkpoint("qwen2", size=size))
    # configs/smollm2_team.py: SmolLM2 is a Llama (tests/cli/test_smollm2_recipe.py runs the real one)
    (tmp_path / "SmolLM2-135M-Instruct").symlink_to(synthetic_checkpoint("llama", size="smoke"))
    (tmp_path / "gsm8k").mkdir()
    shutil.copy("configs/data/gsm8k_smoke.jsonl", tmp_path / "gsm8k" / "train.jsonl")
    monkeypatch.setenv("FLEXMARL_CHECKPOINTS", str(tmp_path))
    monkeypatch.setenv("FLEXMARL_DATA", str(tmp_path))


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_variant_of_every_config_file_is_valid(name, recipe_checkpoints):
    module = importlib.import_module(f"flexmarl_jax.configs.{name[:-3]}")
    assert module.VARIANTS, name
    for variant in ("", *module.VARIANTS):
        # On a CPU host `flexmarl train` fakes mesh.fake_cpu_devices devices (8 unless a variant, such as
        # `faults` with two instances per agent, asks for more).
        spec = f"configs/{name}:{variant}"
        _build(spec, devices=max(8, RunConfig.from_config(load_config(spec)).mesh.fake_cpu_devices))


def test_variants_combine():
    config = _build("configs/debate.py:judge,sync,smoke")
    assert config.workflow.options["aggregate"] == "judge" and config.pipeline.mode == "sync"
    assert config.iterations == 2 and "judge" in config.agents


@pytest.mark.parametrize("overrides, fragment", [
    ({"workflow.roles.solver": "verifier"},
     "config.agents=['corrector', 'solver', 'verifier'] does not match workflow 'chain': agent(s) ['solver'] "
     "play no role (role -> agent: solver->verifier, verifier->verifier, corrector->corrector)"),
    ({"workflow.roles.verifier": "critic"}, "roles are played by undeclared agent(s) ['critic']"),
    ({"workflow.task": "arithmetic", "workflow.task_options.arithmetic.max_digits": "0"}, "max_digits=0"),
    ({"workflow.task": "sudoku"},
     "config.workflow.task='sudoku' is not allowed; choose one of: arithmetic, countdown, reverse, word_problems or a "
     "path"),
    ({"workflow.task": "missing.jsonl"}, "config.workflow.task='missing.jsonl' with task_options.jsonl"),
    ({"workflow.options.corrector_runs": "sometimes"}, "unknown condition 'sometimes'"),
    # Switching workflows keeps chain's sections: one line says what the new workflow takes and where to start.
    ({"workflow.name": "debate"},
     "config.workflow.name='debate' does not take config.workflow options ['corrector_runs'] and shaping_weights "
     "['corrector_fix', 'solver_correct', 'verifier_judgement']; it takes options aggregate, chat, debaters, judge, "
     "max_field_chars, max_field_tokens, rounds, system_prompts, team_weight, templates and shaping weights "
     "debater_correct; a workflow's options, "
     "roles, agents and shaping weights go together: start from --config=configs/debate.py"),
    ({"workflow.name": "tree"},
     "config.workflow.name='tree' is not allowed; choose one of: chain, dag, debate, mixture"),
])
def test_bad_workflow_settings(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _build(overrides=overrides)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, fragment", [
    # The old default task (arithmetic up to 4) has 9 distinct problems (15 prompts): 1% holds out none of them,
    # 99.9% all of them.
    ({"workflow.task": "arithmetic", "eval.fraction": "0.01"},
     "config.eval.fraction=0.01 leaves the eval split empty: none of the 9 distinct "
                                "problems of task 'arithmetic' (in 8192 draws) is held out (raise eval.fraction)"),
    ({"eval.fraction": "0.0"}, "config.eval.fraction=0.0 leaves the eval split empty"),
    ({"workflow.task": "arithmetic", "eval.fraction": "0.999"},
     "config.eval.fraction=0.999 leaves the train split empty: all 9 distinct "
                                 "problems of task 'arithmetic' (in 8192 draws) are held out"),
    ({"workflow.task": "arithmetic", "eval.file": "test.jsonl"},
     "config.eval.file='test.jsonl' takes the eval problems of a .jsonl task, but "
                                  "config.workflow.task='arithmetic' generates its problems"),
])
def test_an_empty_eval_split_is_an_error_naming_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _build(overrides=overrides)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)
    _build(overrides={**overrides, "eval.enabled": "false"})  # no split, no eval: trains on every problem


def test_eval_files_of_a_jsonl_task(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(20)))
    held_out = tmp_path / "test.jsonl"
    held_out.write_text('{"prompt": "7+1=", "answer": "8"}\n{"prompt": "70+1=", "answer": "71"}\n')
    _build(overrides={"workflow.task": str(train), "eval.file": str(held_out)})
    with pytest.raises(ConfigError, match=r"config.eval.file='.*train.jsonl' leaves the train split empty"):
        _build(overrides={"workflow.task": str(train), "eval.file": str(train)})
    with pytest.raises(ConfigError, match=r"config.eval.file='.*missing.jsonl': .*No such file"):
        _build(overrides={"workflow.task": str(train), "eval.file": str(tmp_path / "missing.jsonl")})


def test_task_options_belong_to_their_task():
    config = load_config()
    with config.unlocked():
        config.workflow.task_options.arithmetic.max_number = 3
    with pytest.raises(ConfigError, match=r"task_options.arithmetic: task 'arithmetic' has no option\(s\) "
                                          r"\['max_number'\]; allowed: .*max_answer"):
        RunConfig.from_config(config)
    config = load_config()
    with config.unlocked():
        config.workflow.task_options.sudoku = ml_collections.ConfigDict({"size": 9})
    with pytest.raises(ConfigError, match=r"task_options.sudoku: no task 'sudoku'; tasks: arithmetic, countdown"):
        RunConfig.from_config(config)


@pytest.mark.parametrize("task", ["countdown", "reverse", "arithmetic"])
def test_switching_the_task_uses_that_tasks_own_options(task):
    from flexmarl_jax.config.workflow_from_config import task_from_config

    config = _build(overrides={"workflow.task": task})
    built = task_from_config(config.workflow)
    assert built.name == task
    if task == "countdown":
        assert built.max_number == config.workflow.task_options["countdown"]["max_number"]


def test_switching_the_task_to_a_jsonl_file(tmp_path):
    from flexmarl_jax.config.workflow_from_config import task_from_config

    path = tmp_path / "sums.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    # One problem cannot be split into train and eval problems.
    with pytest.raises(ConfigError, match="none of the 1 distinct problems of task 'jsonl'"):
        _build(overrides={"workflow.task": str(path)})
    config = _build(overrides={"workflow.task": str(path), "eval.enabled": "false"})
    built = task_from_config(config.workflow)
    assert built.verifier_name == config.workflow.task_options["jsonl"]["verifier"] == "numeric"
    assert built.verify(built.generate(1, seed=0)[0], "3.0")


def test_shared_roles_make_one_agent():
    from flexmarl_jax.config.workflow_from_config import team_agents, workflow_from_config

    config = _build("configs/debate.py:shared")
    assert team_agents(config.workflow) == ("debater", "debater2")
    workflow = workflow_from_config(config.workflow)
    played = [workflow.nodes[node].agent for node in workflow.order]
    assert played.count("debater") == 4 and played.count("debater2") == 2  # 2 roles x 2 rounds, 1 x 2


def test_lora_agents_of_one_base_may_differ_in_rank_and_targets_and_join_full_agents():
    """A group of LoRA agents (one model, one dtype) with ranks 8 and 4 and their own targets, beside a full
    fine-tune of the same model in another dtype; each trainer's view carries its own spec."""
    from flexmarl_jax.train.from_config import trainer_config_for

    config = _build(overrides={"agents.solver.lora.rank": "8", "agents.verifier.lora.rank": "4",
                               "agents.verifier.lora.targets": "v_proj,q_proj", "agents.corrector.dtype": "bfloat16"})
    solver, verifier, corrector = (trainer_config_for(config, name).lora
                                   for name in ("solver", "verifier", "corrector"))
    assert (solver.rank, solver.scale, len(solver.targets)) == (8, 2.0, 7)
    assert (verifier.rank, verifier.targets) == (4, ("q_proj", "v_proj"))
    assert corrector.rank == 0
