"""A checkpoint's chat template, rendered the way transformers renders it.

Chat templates are Jinja programs shipped with a checkpoint, so they are untrusted: they run in
jinja2's `ImmutableSandboxedEnvironment` (no attribute access to Python internals, no mutation of
the inputs). The environment matches the one transformers builds for `apply_chat_template`, so a
template renders the same text here as there (tested in tests/models/test_chat_template.py):

- ``trim_blocks`` and ``lstrip_blocks`` (templates are written with block tags on their own lines),
- the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``),
- globals ``raise_exception(message)`` and ``strftime_now(format)``, and a ``tojson`` filter that
  does not escape HTML characters,
- variables ``messages``, ``add_generation_prompt``, ``tools=None``, ``documents=None`` and the
  tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).

Where the template lives: ``chat_template.jinja`` (transformers 5 writes it there) wins over the
``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of ``{name, template}``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused the messages (its `raise_exception`)."""


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to.

    `special_tokens` maps variable names to token text, e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``.
    `origin` (a file path) only labels errors.
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str], origin: str = "chat template"):
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.origin = origin
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.globals["raise_exception"] = self._raise_exception
        environment.globals["strftime_now"] = _strftime_now
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"{origin}: chat template does not compile (line {error.lineno}: {error.message})"
            ) from None

    def _raise_exception(self, message):
        # Templates call this to reject a conversation (e.g. roles that do not alternate); keep it one line.
        raise ChatTemplateError(f"{self.origin}: chat template rejected the messages: {' '.join(str(message).split())}")

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` (``[{"role": ..., "content": ...}, ...]``).

        With `add_generation_prompt` the text ends with the header that starts an assistant turn.
        """
        if not messages:
            raise ValueError(f"{self.origin}: cannot render an empty conversation")
        # Plain dicts of plain values only (the sandbox sees nothing else); keys whose value is None are dropped,
        # as transformers does, so templates test for a missing key rather than print "None".
        plain = [{str(k): v for k, v in dict(message).items() if v is not None} for message in messages]
        variables = {
            **self.special_tokens,
            "messages": plain,
            "add_generation_prompt": bool(add_generation_prompt),
            "tools": None,
            "documents": None,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{self.origin}: chat template failed: {' '.join(str(error).split())}") from None


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat prompts want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def find_chat_template(directory: str | os.PathLike) -> tuple[str, str] | None:
    """``(template source, the file it came from)`` for a checkpoint directory, or None if it has none."""
    directory = os.fspath(directory)
    template_file = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            return f.read(), template_file
    config_file = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        entry = json.load(f).get("chat_template")
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry, config_file
    if isinstance(entry, list):  # several named templates: the "default" one is the chat template
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], config_file
        raise ValueError(
            f"{config_file}: chat_template lists templates {sorted(map(str, named))} but none named 'default'"
        )
    raise ValueError(
        f"{config_file}: chat_template must be a string or a list of {{name, template}}, got {type(entry).__name__}"
    )


def load_chat_template(directory: str | os.PathLike) -> str | None:
    """The chat template source of a checkpoint directory (see the module docstring), or None."""
    found = find_chat_template(directory)
    return None if found is None else found[0]
