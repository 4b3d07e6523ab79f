"""Presets and ModelConfig <-> HF config.json."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.presets import PRESETS, get_preset

# Published parameter counts of the Qwen2.5 base models (model cards / safetensors totals).
QWEN25_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
}


@pytest.mark.parametrize("name", sorted(QWEN25_PARAMS))
def test_qwen25_presets_have_the_published_parameter_counts(name):
    from flexmarl_jax.models.functional import abstract_model, param_count

    config = get_preset(name)
    assert config.num_params() == QWEN25_PARAMS[name]
    if name == "qwen2.5-0.5b":  # eval_shape only: nothing allocated
        assert param_count(abstract_model(config)[1]) == QWEN25_PARAMS[name]


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen9'; allowed: \[.*'tiny'"):
        get_preset("qwen9")


def test_models_package_import_does_not_import_jax():
    import subprocess
    import sys

    code = "import sys, flexmarl_jax.models.presets, flexmarl_jax.models; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_real_qwen25_v4_config_json_parses():
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "torch_dtype": "bfloat16",
    }
    assert ModelConfig.from_hf_config(hf) == get_preset("qwen2.5-0.5b")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
    ],
)
def test_unsupported_hf_fields_are_named(change, message):
    hf = {**get_preset("tiny").to_hf_config(), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(hf)


@given(
    preset=st.sampled_from(sorted(PRESETS)),
    scaling=st.sampled_from(
        [
            None,
            {"rope_type": "linear", "factor": 2.0},
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ]
    ),
    architecture=st.sampled_from(["Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"]),
)
def test_hf_config_round_trip(preset, scaling, architecture):
    config = dataclasses.replace(
        get_preset(preset),
        rope_scaling=scaling,
        architecture=architecture,
        qkv_bias=architecture == "Qwen2ForCausalLM",
        qk_norm=architecture == "Qwen3ForCausalLM",
    )
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    assert hash(ModelConfig.from_hf_config(config.to_hf_config())) == hash(config)


def test_invalid_shapes_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        dataclasses.replace(get_preset("tiny"), num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="hidden_size=0"):
        dataclasses.replace(get_preset("tiny"), hidden_size=0)
