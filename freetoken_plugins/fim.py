"""The fim plugin: the completions field ``suffix``, laid out as a fill-in-the-middle prompt.

Request field: ``suffix`` (``POST /v1/completions`` only, and offline), a string. When it is
present the server (or ``LLM.generate``) calls ``freetoken_rewrite_prompt`` for each prompt
before tokenization, and this plugin returns the prompt in PSM order with the model's own
FIM tokens::

    <prefix-token>{prompt}<suffix-token>{suffix}<middle-token>

The model then generates the middle. The FIM tokens are found in the tokenizer's
vocabulary, in this order of preference (``FIM_STYLES``):

- StarCoder / SmolLM: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``;
- Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``;
- DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>``.

CodeLlama's ``<PRE>``/``<SUF>``/``<MID>`` are not detected: SentencePiece stores them as
``▁<PRE>`` etc. with a layout that depends on spaces, and no test model has them.

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
FIM_STYLES: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
"""``(prefix, suffix, middle)`` token triples, most common first."""


def _has_token(tokenizer: Any, token: str) -> bool:
    """Whether ``token`` is one whole entry of the vocabulary (added tokens included)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None:
        return False
    unk = getattr(tokenizer, "unk_token_id", None)
    return token_id != unk or getattr(tokenizer, "unk_token", None) == token


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's ``(prefix, suffix, middle)`` FIM tokens, or ``None`` when it has none."""
    for style in FIM_STYLES:
        if all(_has_token(tokenizer, t) for t in style):
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
