"""Chat templates render what transformers renders; the sandbox holds; errors are one line naming the file."""

import json

import pytest

from flexmarl_jax.models.chat_template import ChatTemplate, ChatTemplateError, find_chat_template, load_chat_template
from flexmarl_jax.models.tokenizer import HFTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Ava has 3 apples and buys 4 more. How many now?"}],
    [
        {"role": "system", "content": "You are a careful math solver."},
        {"role": "user", "content": "  12 * 7 = ?\n\nShow the steps.  "},
        {"role": "assistant", "content": "12 * 7 = 84. The answer is 84."},
        {"role": "user", "content": "Check it: is \\boxed{84} right? <b>&</b> 'quotes' \"too\" é 😀"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "{{ not jinja }} {% raw %}"}],
]

# Templates written to exercise each renderer setting transformers uses; rendered by both sides.
SETTING_TEMPLATES = {
    "trim_and_lstrip_blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\nQ: {{ m.content }}\n"
    "    {% else %}\n{{ m.role }}> {{ m.content }}\n    {% endif %}\n{% endfor %}\n",
    "loopcontrols": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.content }}|{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}",
    "special_tokens_and_generation_prompt": "{{ bos_token }}[{{ eos_token }}|{{ pad_token }}]"
    "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}",
    "tojson_and_namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ m | tojson }}{% endfor %}{{ ns.n }}{% if tools is none and documents is none %}!{% endif %}",
}


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama", "llama_jinja"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_fixture_templates_render_what_transformers_renders(
    name, add_generation_prompt, synthetic_dirs, auto_tokenizers
):
    ours = HFTokenizer(synthetic_dirs[name])
    for messages in CONVERSATIONS:
        theirs = auto_tokenizers[name].apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == theirs
        # the token ids of the prompt agree too (what rollout will feed the model)
        assert (
            ours.encode(theirs, add_bos=False) == auto_tokenizers[name](theirs, add_special_tokens=False)["input_ids"]
        )


def test_templates_come_from_the_file_transformers_reads(synthetic_dirs):
    assert find_chat_template(synthetic_dirs["llama"])[1].endswith("tokenizer_config.json")
    assert find_chat_template(synthetic_dirs["llama_jinja"])[1].endswith("chat_template.jinja")
    assert load_chat_template(synthetic_dirs["llama"]) == load_chat_template(synthetic_dirs["llama_jinja"])
    rendered = HFTokenizer(synthetic_dirs["llama"]).render_chat(CONVERSATIONS[0])
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAva has")
    assert rendered.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert HFTokenizer(synthetic_dirs["qwen2"]).render_chat(CONVERSATIONS[0], add_generation_prompt=False) == (
        "<|im_start|>user\nAva has 3 apples and buys 4 more. How many now?<|im_end|>\n"
    )


@pytest.mark.parametrize("source_name", sorted(SETTING_TEMPLATES))
def test_renderer_settings_match_transformers(source_name, synthetic_dirs, auto_tokenizers):
    source = SETTING_TEMPLATES[source_name]
    theirs = auto_tokenizers["llama"]
    ours = ChatTemplate(source, special_tokens=theirs.special_tokens_map)
    assert set(theirs.special_tokens_map) == {"bos_token", "eos_token", "pad_token"}
    assert HFTokenizer(synthetic_dirs["llama"]).chat_template.special_tokens == theirs.special_tokens_map
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(
                messages, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected


def _one_line_naming(error, file_name):
    message = str(error.value)
    assert "\n" not in message and file_name in message, message
    return message


def test_raise_exception_is_one_line_naming_the_template_file(synthetic_dirs):
    tokenizer = HFTokenizer(synthetic_dirs["qwen2"])
    with pytest.raises(ChatTemplateError) as error:
        tokenizer.render_chat([{"role": "tool", "content": "x"}])
    message = _one_line_naming(error, "tokenizer_config.json")
    assert message.endswith("chat template rejected the messages: unsupported role tool; use system, user or assistant")
    late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ValueError, match="a system message may only come first"):
        tokenizer.render_chat(late_system)


def test_sandbox_refuses_python_internals_and_mutation():
    messages = [{"role": "user", "content": "hi"}]
    escapes = [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__ }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set d = messages[0] %}{{ d.update({'role': 'x'}) }}",
    ]
    for source in escapes:
        with pytest.raises(ChatTemplateError) as error:
            ChatTemplate(source, special_tokens={}, origin="/m/chat_template.jinja").render(messages)
        _one_line_naming(error, "/m/chat_template.jinja")
    assert messages == [{"role": "user", "content": "hi"}]


def test_broken_template_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n")
    source, origin = find_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError) as error:
        ChatTemplate(source, special_tokens={}, origin=origin)
    assert "does not compile (line 2" in _one_line_naming(error, str(tmp_path / "chat_template.jinja"))
    with pytest.raises(ValueError, match="empty conversation"):
        ChatTemplate("x", special_tokens={}).render([])


def test_template_locations_and_their_precedence(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    assert load_chat_template(tmp_path) is None  # no tokenizer_config.json at all
    config.write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None
    config.write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"  # the file wins, as in transformers 5
    (tmp_path / "chat_template.jinja").unlink()
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError) as error:
        load_chat_template(tmp_path)
    assert "none named 'default'" in _one_line_naming(error, str(config))
    config.write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match="must be a string or a list"):
        load_chat_template(tmp_path)
