"""Small random-init Hugging Face checkpoints with a real tokenizer, for tests and CPU smoke runs.

`make_checkpoint` writes what a downloaded Qwen2 / Qwen3 / Llama directory holds, at a size a 2-core
CPU trains in seconds: ``config.json`` + ``model.safetensors`` (random init by `random_params`, written
by `save_pretrained`), ``tokenizer.json`` (a byte-level BPE trained with `tokenizers` on a
generated corpus of arithmetic word problems and chat transcripts), ``tokenizer_config.json`` with the
chat template (or ``chat_template.jinja``) and ``generation_config.json`` whose ``eos_token_id`` is a
list, as chat models ship it.

The families differ as the real ones do, so a team of two exercises two tokenizers and templates:
Qwen2 and Qwen3 share a ChatML tokenizer (``<|im_start|>``/``<|im_end|>``, no BOS); Llama has a
Llama-3-style one (a BOS that the tokenizer adds, ``<|start_header_id|>`` headers, ``<|eot_id|>``)
with another vocabulary size. Every file is a function of (architecture, size, seed, vocab_size); the
tokenizer depends on the family and vocab_size only, so checkpoints of one family with different seeds
(different weights) share it, as a family's real sizes do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flexmarl_jax.models.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, ChatTemplate
from flexmarl_jax.models.checkpoint import save_pretrained
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.functional import abstract_model

# The template sources below are written for this project. They lean on the renderer's settings the way
# published templates do: trim_blocks drops the newline after a block tag, lstrip_blocks the indentation
# before it, so only the literal lines between block tags reach the prompt.
CHATML_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unsupported role ' + message['role'] + '; use system, user or assistant') }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('a system message may only come first') }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

HEADER_TEMPLATE = """\
{{ bos_token }}{% for message in messages %}
    {% if message['content'] is not defined %}
        {% continue %}
    {% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""


@dataclasses.dataclass(frozen=True)
class ChatStyle:
    """A tokenizer family: its special tokens (ids 0..k-1 in this order) and chat template."""

    name: str
    specials: tuple[str, ...]
    bos: str | None  # added in front of every encoded text, by the tokenizer itself
    eos: str  # tokenizer_config's eos_token: the end of an assistant turn
    end_of_text: str  # also a stop id, and the pad token
    template: str


CHATML = ChatStyle(
    "chatml",
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None,
    eos="<|im_end|>",
    end_of_text="<|endoftext|>",
    template=CHATML_TEMPLATE,
)
HEADERS = ChatStyle(
    "headers",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    end_of_text="<|end_of_text|>",
    template=HEADER_TEMPLATE,
)
_STYLES = {style.name: style for style in (CHATML, HEADERS)}


@dataclasses.dataclass(frozen=True)
class Family:
    """How one architecture's fixture looks: its tokenizer style, default vocabulary and config traits."""

    architecture: str
    style: ChatStyle
    vocab_size: int  # of the tokenizer; the embedding is padded to a multiple of 128
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    head_dim_factor: int = 1  # head_dim = hidden / heads * this
    rope_scaling: dict | None = None


FAMILIES: dict[str, Family] = {
    # Qwen2 (q/k/v biases follow from the architecture) and Qwen3 (q/k RMSNorm, head_dim above hidden/heads)
    # share a tokenizer, as Qwen2.5 and Qwen3 do; both tie the embeddings, as their small sizes do.
    "qwen2": Family("Qwen2ForCausalLM", CHATML, 2000, True, 1e6, 1e-6),
    "qwen3": Family("Qwen3ForCausalLM", CHATML, 2000, True, 1e6, 1e-6, head_dim_factor=2),
    # Llama: its own tokenizer and template, an untied head and Llama-3 RoPE scaling.
    "llama": Family(
        "LlamaForCausalLM",
        HEADERS,
        2500,
        False,
        500000.0,
        1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
}

# size -> (hidden, intermediate, layers, heads, kv heads). "smoke" is ~1M parameters, "small" ~4M.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "smoke": (128, 384, 2, 4, 2),
    "small": (256, 768, 4, 8, 2),
}
MAX_POSITIONS = 4096
_MIN_VOCAB = 512
_EMBED_MULTIPLE = 128


def model_config(architecture: str, size: str, tokenizer_size: int) -> ModelConfig:
    """The ModelConfig of a fixture whose tokenizer has `tokenizer_size` ids."""
    family = _family(architecture)
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not a fixture size; allowed: {sorted(SIZES)}")
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    return ModelConfig(
        vocab_size=-(-tokenizer_size // _EMBED_MULTIPLE) * _EMBED_MULTIPLE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads * family.head_dim_factor,
        rope_theta=family.rope_theta,
        rope_scaling=family.rope_scaling,
        rms_norm_eps=family.rms_norm_eps,
        tie_word_embeddings=family.tie_word_embeddings,
        qkv_bias=family.architecture == "Qwen2ForCausalLM",
        qk_norm=family.architecture == "Qwen3ForCausalLM",
        max_position_embeddings=MAX_POSITIONS,
        architecture=family.architecture,
    )


def make_checkpoint(
    out_dir: str | os.PathLike,
    architecture: str,
    *,
    size: str = "smoke",
    seed: int = 0,
    chat_template_file: bool = False,
    vocab_size: int | None = None,
) -> str:
    """Writes a random-init HF checkpoint of `architecture` ("qwen2" | "qwen3" | "llama") into `out_dir`.

    `vocab_size` is the tokenizer's vocabulary (default per family: 2000 ChatML, 2500 Llama-style); the
    model's embedding is that rounded up to a multiple of 128, so it has rows no token uses, as real
    checkpoints do. With `chat_template_file` the template goes to ``chat_template.jinja`` (as
    transformers 5 writes it) instead of ``tokenizer_config.json``. Returns `out_dir`.

    `out_dir` must not exist or be empty: the files are written to a sibling directory that is then
    renamed, so a reader never sees half a checkpoint and stale files never mix in.
    """
    family = _family(architecture)
    vocab_size = family.vocab_size if vocab_size is None else vocab_size
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} must be >= {_MIN_VOCAB} (256 byte tokens, specials, merges)")
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir} already exists and is not an empty directory; choose a new path")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        _write_checkpoint(staging, architecture, size, seed, chat_template_file, vocab_size)
        os.chmod(staging, 0o755)  # mkdtemp makes it private to the user
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above); rename cannot replace a directory on every platform
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_checkpoint(out_dir: str, architecture: str, size: str, seed: int, chat_template_file: bool, vocab_size: int):
    style = _family(architecture).style
    tokenizer_json = trained_tokenizer_json(style.name, vocab_size)
    token_ids = {token["content"]: token["id"] for token in json.loads(tokenizer_json)["added_tokens"]}
    config = model_config(architecture, size, _tokenizer_size(tokenizer_json))
    save_pretrained(random_params(config, seed), out_dir)
    eos, end_of_text = token_ids[style.eos], token_ids[style.end_of_text]
    bos = token_ids[style.bos] if style.bos else end_of_text  # Qwen's config.json names one it never adds
    _update_json(os.path.join(out_dir, "config.json"), bos_token_id=bos, eos_token_id=eos)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": bos,
            "eos_token_id": [eos, end_of_text],
            "pad_token_id": end_of_text,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
        },
    )
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos,
        "eos_token": style.eos,
        "pad_token": style.end_of_text,
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template_file:
        with open(os.path.join(out_dir, TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(style.template)
    else:
        tokenizer_config["chat_template"] = style.template
    _write_json(os.path.join(out_dir, TOKENIZER_CONFIG_FILE), tokenizer_config)


def random_params(config: ModelConfig, seed: int):
    """(graphdef, params) drawn with numpy: weights N(0, 0.02) as `init_params` draws them, norm scales
    1 + N(0, 0.02) and biases N(0, 0.02) (so that every parameter moves the logits in parity tests).

    numpy rather than `init_params` because the latter compiles an initializer per architecture, which
    costs seconds on a 2-core CPU; these fixtures are made in well under one.
    """
    graphdef, abstract = abstract_model(config)
    rng = np.random.default_rng(seed)
    drawn = []
    for path, variable in nnx.to_flat_state(abstract):  # a fixed (sorted) order: the same seed, the same draws
        noise = 0.02 * rng.standard_normal(variable.shape, dtype=np.float32)
        value = 1.0 + noise if path[-1] == "scale" else noise
        drawn.append((path, variable.replace(jnp.asarray(value))))
    return graphdef, nnx.from_flat_state(drawn)


@functools.lru_cache(maxsize=8)
def trained_tokenizer_json(style_name: str, vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE trained on `corpus(style)` (cached: training takes ~1 s).

    The corpus supports vocabularies up to about 3400 ids; a larger `vocab_size` gives that many.
    """
    style = _STYLES[style_name]
    tokenizer = Tokenizer(models.BPE())
    # Digits one by one (as Qwen does), then GPT-2's byte-level split: any text encodes, no unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if style.bos is None:
        tokenizer.post_processor = byte_level
    else:  # the tokenizer itself puts BOS in front when asked for special tokens (as Llama 3's does)
        bos_id = style.specials.index(style.bos)  # the trainer gives specials ids 0..k-1 in order
        add_bos = processors.TemplateProcessing(
            single=f"{style.bos} $A", pair=f"{style.bos} $A {style.bos} $B", special_tokens=[(style.bos, bos_id)]
        )
        tokenizer.post_processor = processors.Sequence([byte_level, add_bos])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(style.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(style), trainer=trainer)
    return tokenizer.to_str()


def corpus(style: ChatStyle, problems: int = 2000) -> list[str]:
    """Generated training text: word problems, worked answers in several formats, and chat transcripts."""
    rng = random.Random(0)  # one corpus per style: the tokenizer does not depend on the checkpoint's seed
    template = ChatTemplate(style.template, special_tokens={"bos_token": style.bos or "", "eos_token": style.eos})
    lines = []
    for _ in range(problems):
        question, steps, answer = _word_problem(rng)
        solution = f"{steps} The answer is {answer}."
        lines += [question, solution, f"{steps}\n#### {answer}", f"\\boxed{{{answer}}}"]
        messages = [
            {"role": "system", "content": rng.choice(_ROLE_PROMPTS)},
            {"role": "user", "content": question},
            {"role": "assistant", "content": solution},
        ]
        lines.append(template.render(messages, add_generation_prompt=False) + style.end_of_text)
    return lines


# Names are built from syllables so that the corpus holds thousands of distinct words: byte-level BPE only
# merges inside words, and a vocabulary of a few thousand needs that many word pieces to learn.
_SYLLABLES = tuple(
    "ka ro mi len sa to bel na vi dor ha ju ne pa ri ol an ez ti mar quo fen ly gus wei yan ba chi da ek zo ul".split()
)
_ITEMS = tuple(
    "apples books coins marbles pencils stickers cookies cards shells stamps oranges crayons buttons "
    "balloons seeds beads tickets eggs flowers kites".split()
)
_ROLE_PROMPTS = (
    "You are a careful math solver. Think step by step and end with 'The answer is N'.",
    "You are a verifier. Check the solution and say whether the final answer is correct.",
    "You are a corrector. Fix any mistake in the solution and give the final answer.",
    "You are a helpful assistant.",
)


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def _word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked steps, answer) of one of four arithmetic problem shapes."""
    name, friend = _name(rng), _name(rng)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, 99), rng.randint(2, 60)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {item}.",
            a + b,
        )
    if kind == 1:
        a += b
        return (
            f"{name} had {a} {item} and gave {b} to {friend}. How many {item} are left?",
            f"{a} - {b} = {a - b} {item} are left.",
            a - b,
        )
    if kind == 2:
        a = a % 12 + 2
        return (
            f"Each box holds {a} {item}. How many {item} are in {b} boxes?",
            f"{b} boxes hold {b} * {a} = {a * b} {item}.",
            a * b,
        )
    share = a % 20 + 1
    b = b % 9 + 2
    return (
        f"{share * b} {item} are shared equally among {b} friends. How many {item} does each friend get?",
        f"Each friend gets {share * b} / {b} = {share} {item}.",
        share,
    )


def _family(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise ValueError(f"architecture={architecture!r} has no fixture; allowed: {sorted(FAMILIES)}")
    return FAMILIES[architecture]


def _tokenizer_size(tokenizer_json: str) -> int:
    data = json.loads(tokenizer_json)
    ids = list(data["model"]["vocab"].values()) + [token["id"] for token in data["added_tokens"]]
    return max(ids) + 1


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def _update_json(path: str, **changes) -> None:
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    value.update(changes)
    _write_json(path, value)
