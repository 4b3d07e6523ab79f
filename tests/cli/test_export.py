"""`flexmarl export`: the exported directory reloads in transformers with our logits and our tokenizer's ids.

The workdir is made here the way `flexmarl train` leaves one: config.json (a RunConfig) and Orbax checkpoints
written by `save_all` under checkpoints/<agent>/<policy_version>.
"""

import dataclasses
import json
import os
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmarl_jax.cli.main import main
from flexmarl_jax.config import RunConfig, load_config
from flexmarl_jax.models import functional
from flexmarl_jax.models.checkpoint import from_pretrained
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.synthetic import make_checkpoint
from flexmarl_jax.models.tokenizer import CharTokenizer, HFTokenizer
from flexmarl_jax.train.checkpoint import save_all
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import trainer_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TRAINER = trainer_config(micro_batch_size=2, max_len=8)  # the checkpoint also holds Adam's moments of the policy
TEXTS = ["1+2=3", "What is 7 + 5?\nAnswer: 12", "x", "  spaced\tout  {braces} ~end~"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [{"role": "system", "content": "You check answers."},
     {"role": "user", "content": "Solver said: 12.\nIs it right?"}],
    [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "6"},
     {"role": "user", "content": "and 2*4?"}],
]


def _write_workdir(workdir, trainers: dict, models: dict[str, str]) -> None:
    """config.json (the default team with `models` swapped in) and a checkpoint of each trainer."""
    config = RunConfig.from_config(load_config())
    agents = {name: dataclasses.replace(agent, model=models.get(name, agent.model))
              for name, agent in config.agents.items()}
    config = dataclasses.replace(config, workdir=str(workdir), agents=agents)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as handle:
        handle.write(config.to_json())
    save_all(trainers, os.path.join(workdir, "checkpoints"))


def _perturb(trainer: AgentTrainer, policy_version: int) -> None:
    """Moves every parameter, as an update would, and sets the version."""
    rng = np.random.default_rng(policy_version)
    state = trainer.checkpoint_state()
    state["trainable"]["policy"] = jax.tree.map(
        lambda leaf: jax.device_put(np.asarray(leaf) + rng.normal(0, 0.05, leaf.shape).astype(leaf.dtype),
                                    leaf.sharding), state["trainable"]["policy"])
    trainer.load_checkpoint_state(state, policy_version)


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    """A workdir whose solver (the "tiny" preset) was saved at versions 0 and 1; no other agent was saved."""
    workdir = tmp_path_factory.mktemp("run")
    solver = AgentTrainer("solver", get_preset("tiny"), TRAINER, seed=0)
    policies = {}
    for version in (0, 1):
        if version:
            _perturb(solver, version)
        policies[version] = jax.device_get(solver.params)
        _write_workdir(workdir, {"solver": solver}, {})
    return workdir, solver.graphdef, policies


def _export(capsys, *args) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _right_padded(sequences: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """[batch, longest] token ids and attention mask (padding after each sequence leaves its logits alone)."""
    longest = max(map(len, sequences))
    tokens = np.array([ids + [pad_id] * (longest - len(ids)) for ids in sequences], np.int32)
    return tokens, np.array([[i < len(ids) for i in range(longest)] for ids in sequences])


def _assert_same_logits(model, graphdef, params, sequences: list[list[int]], pad_id: int) -> None:
    """transformers' float32 logits equal ours within 1e-4 at every real position of every sequence."""
    tokens, mask = _right_padded(sequences, pad_id)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    ours = np.asarray(jax.jit(functional.forward, static_argnums=0)(graphdef, params, tokens, positions, mask))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long()).logits.numpy()
    np.testing.assert_allclose(theirs[mask], ours[mask], atol=1e-4, rtol=0)


def test_preset_agent_reloads_in_transformers_with_our_logits(preset_run, tmp_path, capsys):
    workdir, graphdef, policies = preset_run
    tokenizer = CharTokenizer()
    ids = [tokenizer.encode(text) for text in TEXTS]
    for version, flags in ((1, []), (0, ["--version", "0"])):
        out = tmp_path / f"v{version}"
        code, stdout, _ = _export(capsys, workdir, "--agent", "solver", "--out", out, *flags)
        assert code == 0
        assert stdout.count("\n") == 1 and f"policy_version {version} (Qwen2ForCausalLM" in stdout
        assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                           "tokenizer.json", "tokenizer_config.json"]
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        _assert_same_logits(model, graphdef, policies[version], ids, tokenizer.pad_id)
        # the other version is a different model, so the check above tells versions apart
        with pytest.raises(AssertionError):
            _assert_same_logits(model, graphdef, policies[1 - version], ids, tokenizer.pad_id)

    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "v1")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)


@pytest.fixture(scope="module")
def exported_char_tokenizer(preset_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "solver"
    assert main(["export", str(preset_run[0]), "--agent", "solver", "--out", str(out)]) == 0
    return out, transformers.AutoTokenizer.from_pretrained(out)


# Texts of CharTokenizer's characters, with the special tokens' names as plain text among them.
PRINTABLE_TEXT = st.lists(st.sampled_from([*string.printable, "<s>", "</s>", "<pad>"]), max_size=40).map("".join)
# Any text: characters outside the vocabulary (one UNK each), combining marks, U+FFFD itself.
UNICODE_TEXT = st.lists(st.sampled_from([*string.printable, "é", "e\u0301", "☃", "😀", "\ufffd", "ß"]),
                        max_size=40).map("".join)
CHAR_IDS = st.lists(st.integers(0, CharTokenizer().vocab_size - 1), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=PRINTABLE_TEXT, ids=CHAR_IDS)
def test_exported_char_tokenizer_encodes_and_decodes_like_ours_in_transformers(exported_char_tokenizer, text, ids):
    _, theirs = exported_char_tokenizer  # transformers 5 reads a qwen2 model's tokenizer as Qwen2Tokenizer
    ours = CharTokenizer()
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_bos=False)
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, len(theirs)) == (
        ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=UNICODE_TEXT, ids=CHAR_IDS)
def test_exported_char_tokenizer_file_equals_ours_on_any_text(exported_char_tokenizer, text, ids):
    ours, reloaded = CharTokenizer(), HFTokenizer(exported_char_tokenizer[0])  # tokenizer.json as written
    assert (reloaded.bos_id, reloaded.eos_id, reloaded.pad_id, reloaded.vocab_size) == (
        ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size)
    assert reloaded.encode(text) == ours.encode(text)
    assert reloaded.encode(text, add_bos=False) == ours.encode(text, add_bos=False)
    assert reloaded.decode(ids) == ours.decode(ids)


def _snapshot(directory) -> dict[str, float]:
    return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
            for root, dirs, files in os.walk(directory) for name in dirs + files}


@pytest.mark.parametrize("case, fragment", [
    ("unknown_agent", "unknown agent 'critic'; agents in"),
    ("agent_never_saved", "no checkpoints of agent 'verifier' under"),
    ("version_not_saved", "agent 'solver' has no checkpoint at --version 7 under"),
    ("no_config", "config.json not found: WORKDIR must be a directory written by `flexmarl train`"),
    ("out_not_empty", "is not empty; pass --force to replace it"),
    ("model_changed", "does not match config.agents.solver.model='small' (differs in hidden_size"),
    ("source_lost_tokenizer", "tokenizer.json is missing: the checkpoint has no tokenizer files"),
    ("out_is_the_run", "which export reads; choose another directory"),
])
def test_bad_input_is_one_line_and_writes_nothing(preset_run, tmp_path, capsys, case, fragment):
    workdir, agent, out, extra = preset_run[0], "solver", tmp_path / "new" / "solver", []
    if case == "unknown_agent":
        agent = "critic"
    elif case == "agent_never_saved":
        agent = "verifier"
    elif case == "version_not_saved":
        extra = ["--version", "7"]
    elif case == "no_config":
        workdir = tmp_path / "empty"
        workdir.mkdir()
    elif case == "out_is_the_run":  # even with --force
        out, extra = workdir, ["--force"]
    elif case == "out_not_empty":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
    elif case in ("model_changed", "source_lost_tokenizer"):  # the agent's model source changed since training
        model = "small"
        if case == "source_lost_tokenizer":
            model = make_checkpoint(str(tmp_path / "source"), "qwen3")
            os.remove(os.path.join(model, "tokenizer.json"))
        workdir = tmp_path / "changed"
        workdir.mkdir()
        config = json.loads((preset_run[0] / "config.json").read_text())
        config["agents"]["solver"]["model"] = model
        (workdir / "config.json").write_text(json.dumps(config))
        os.symlink(preset_run[0] / "checkpoints", workdir / "checkpoints")
    before = _snapshot(tmp_path), _snapshot(preset_run[0])

    code, stdout, stderr = _export(capsys, workdir, "--agent", agent, "--out", out, *extra)
    assert code == 2 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexmarl export: ") and fragment in lines[0], stderr
    assert (_snapshot(tmp_path), _snapshot(preset_run[0])) == before  # nothing written, nothing touched


def test_force_replaces_a_non_empty_directory(preset_run, tmp_path, capsys):
    out = tmp_path / "solver"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    code, _, _ = _export(capsys, preset_run[0], "--agent", "solver", "--out", out, "--force")
    assert code == 0
    assert "stale.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert os.listdir(tmp_path) == ["solver"]  # no staging directory left beside it


def test_bfloat16_agent_exports_its_bfloat16_weights_bit_for_bit(tmp_path, capsys):
    graphdef, params = functional.init_params(get_preset("tiny"), seed=5, dtype=jnp.bfloat16)
    solver = AgentTrainer("solver", get_preset("tiny"), dataclasses.replace(TRAINER, dtype="bfloat16"),
                          initial=(graphdef, params))
    _write_workdir(tmp_path / "run", {"solver": solver}, {})
    code, stdout, _ = _export(capsys, tmp_path / "run", "--agent", "solver", "--out", tmp_path / "out")
    assert code == 0 and "bfloat16)" in stdout
    reloaded = from_pretrained(tmp_path / "out", dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    for ours, theirs in zip(jax.tree.leaves(solver.params), jax.tree.leaves(reloaded.params), strict=True):
        assert theirs.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(theirs).view(np.uint16), np.asarray(ours).view(np.uint16))


@pytest.mark.parametrize("architecture, template_file", [
    ("qwen3", True),  # ChatML, no BOS, the template in chat_template.jinja (as transformers 5 writes it)
    ("llama", False),  # Llama-3 style headers, a BOS, the template in tokenizer_config.json
])
def test_checkpoint_dir_agent_keeps_its_tokenizer_and_chat_template(tmp_path, capsys, architecture, template_file):
    source = make_checkpoint(str(tmp_path / "source"), architecture, chat_template_file=template_file)
    pretrained = from_pretrained(source)
    solver = AgentTrainer("solver", pretrained.config, TRAINER, initial=(pretrained.graphdef, pretrained.params))
    _perturb(solver, 3)
    workdir = tmp_path / "run"
    _write_workdir(workdir, {"solver": solver}, {"solver": source})

    out = tmp_path / "export"
    code, stdout, _ = _export(capsys, workdir, "--agent", "solver", "--out", out)
    assert code == 0 and f"policy_version 3 ({pretrained.config.architecture}" in stdout
    for name in os.listdir(source):  # tokenizer, chat template and generation config, unchanged
        if not name.endswith(".safetensors") and name != "config.json":
            assert (out / name).read_bytes() == (tmp_path / "source" / name).read_bytes(), name

    ours, theirs = HFTokenizer(source), transformers.AutoTokenizer.from_pretrained(out)
    for messages in CONVERSATIONS:
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == ours.render_chat(messages) == HFTokenizer(out).render_chat(messages)
        assert theirs(rendered, add_special_tokens=False)["input_ids"] == ours.encode(rendered, add_bos=False)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompts = [ours.encode(ours.render_chat(messages), add_bos=False) for messages in CONVERSATIONS]
    _assert_same_logits(model, solver.graphdef, solver.params, [*map(ours.encode, TEXTS), *prompts], ours.pad_id)
