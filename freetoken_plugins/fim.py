"""The fim plugin: the completions field ``suffix``, laid out as a fill-in-the-middle prompt.

Request field: ``suffix`` (``POST /v1/completions`` only, and offline), a string. When it is
present the server (or ``LLM.generate``) calls ``freetoken_rewrite_prompt`` for each prompt
before tokenization, and this plugin returns the prompt in PSM order with the model's own
FIM tokens::

    <prefix-token>{prompt}<suffix-token>{suffix}<middle-token>

The model then generates the middle. The FIM tokens are found in this order:

1. The model's metadata: a GGUF file's ``tokenizer.ggml.fim_pre_token_id`` /
   ``fim_suf_token_id`` / ``fim_mid_token_id``, which FreeToken's conversion records by
   their text under ``fim_tokens`` (``{"pre", "suf", "mid"}``) in ``tokenizer_config.json``
   and transformers hands back in the tokenizer's ``init_kwargs``. The texts may be
   anything the model calls them.
2. Their text in the tokenizer's vocabulary (``FIM_STYLES``, in this order): the three
   spellings this plugin always knew, then the others llama.cpp's ``src/llama-vocab.cpp``
   recognises:

   - StarCoder / SmolLM / Granite: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``;
   - Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``;
   - DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>``;
   - ``<fim-prefix>``, ``<fim-suffix>``, ``<fim-middle>``;
   - CodeLlama: ``<PRE>``, ``<SUF>``, ``<MID>``, and ``▁<PRE>``, ``▁<SUF>``, ``▁<MID>`` as
     its SentencePiece vocabulary spells them;
   - GLM-4.5: ``<|code_prefix|>``, ``<|code_suffix|>``, ``<|code_middle|>``;
   - Falcon-H1-Tiny-Coder: ``<|prefix|>``, ``<|suffix|>``, ``<|middle|>``.

A triple counts only when each of its texts is an added token of the tokenizer (one it
matches whole wherever a text has it, so the laid-out text tokenizes to it); otherwise the
next source is tried. llama.cpp matches each of the three on its own; here they are taken as a triple, so
a layout never mixes two models' conventions. No spaces are added around the tokens (as
llama.cpp's infill puts the prefix, suffix and middle ids next to the texts' tokens).

Errors (all HTTP 400 with ``param == "suffix"``):

- a model whose vocabulary has none of these triples: "this model has no
  fill-in-the-middle tokens" (SmolLM2-Instruct, the default model, has none);
- a prompt given as token ids (``[int]`` or ``[[int]]``): the layout is text, and guessing
  where the ids' text would split is worse than asking for a text prompt;
- a ``suffix`` that is not a string (its type, ``Fim.Fields``);
- ``suffix`` on the chat route;
- ``suffix`` with the plugin not enabled: the server names this plugin.

An empty ``suffix`` is a valid FIM request (fill at the end of the prefix).
"""

from __future__ import annotations

from typing import Any

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import Plugin, PromptView, RequestFields

FIELD = "suffix"
METADATA_KEY = "fim_tokens"
"""The tokenizer_config.json key (a tokenizer ``init_kwargs`` key) where FreeToken's GGUF
conversion records the metadata's FIM tokens: ``{"pre": ..., "suf": ..., "mid": ...}``."""
FIM_STYLES: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<PRE>", "<SUF>", "<MID>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),
    ("<|prefix|>", "<|suffix|>", "<|middle|>"),
)
"""``(prefix, suffix, middle)`` token triples, in the order they are tried."""


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (text -> id): the ones it matches whole wherever a text
    has them, which a FIM token must be for the laid-out text to tokenize to it."""
    return dict(tokenizer.get_added_vocab())


def metadata_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The ``(prefix, suffix, middle)`` tokens the model's metadata names
    (:data:`METADATA_KEY`), or ``None`` when it names no complete triple."""
    named = (getattr(tokenizer, "init_kwargs", None) or {}).get(METADATA_KEY)
    if not isinstance(named, dict):
        return None
    triple = tuple(named.get(key) for key in ("pre", "suf", "mid"))
    if not all(isinstance(t, str) and t for t in triple):
        return None
    return triple  # type: ignore[return-value]


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's ``(prefix, suffix, middle)`` FIM tokens, or ``None`` when it has none:
    the metadata's, else the first of ``FIM_STYLES`` the vocabulary has."""
    named = metadata_tokens(tokenizer)
    added = _added_tokens(tokenizer)
    for style in (named, *FIM_STYLES) if named is not None else FIM_STYLES:
        if all(t in added for t in style):
            return style
    return None


def fim_prompt(tokenizer: Any, prefix: str, suffix: str) -> str:
    """The PSM prompt text for ``prefix`` and ``suffix``; ``InvalidRequest`` naming
    ``suffix`` when the model has no FIM tokens. The text is tokenized as usual: the
    tokenizer matches the FIM tokens whole because they are added tokens."""
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        raise InvalidRequest(FIELD, "suffix needs fill-in-the-middle: this model has no "
                                    "fill-in-the-middle tokens (e.g. <fim_prefix>, "
                                    "<fim_suffix>, <fim_middle>)")
    begin, hole, end = tokens
    return f"{begin}{prefix}{hole}{suffix}{end}"


class Fim(Plugin):
    """suffix: lay out prompt and suffix as a fill-in-the-middle prompt."""

    class Fields(RequestFields):
        suffix: str | None = None

    routes = frozenset({"completions"})

    @staticmethod
    @hookimpl
    def freetoken_rewrite_prompt(prompt: PromptView) -> str | None:
        fields = prompt.params.fields.get("fim")
        if fields is None:
            return None
        if not isinstance(prompt.prompt, str):
            raise InvalidRequest(FIELD, "suffix needs the prompt as text (a string or a list "
                                        "of strings), not token ids")
        return fim_prompt(prompt.tokenizer, prompt.prompt, fields.suffix)
