"""The reasoning plugin: split ``<think>…</think>`` out of chat answers and count it.

Switch: no request field. Like vLLM's ``--reasoning-parser``, it is on for every
``POST /v1/chat/completions`` while the plugin is enabled and the model's vocabulary has
``<think>`` and ``</think>`` as whole tokens (Qwen3, DeepSeek-R1 and the test tokenizer do;
SmolLM2 does not, so there it does nothing). Turn it off with ``--plugins`` without
``reasoning``. Completions are never touched.

Semantics, per choice, on the generated text (``ThinkSplitter``):

- The answer starts *inside* reasoning when the prompt left a ``<think>`` open (its last
  ``<think>`` token comes after its last ``</think>``, as templates that open the block
  for the model do); otherwise it starts in content.
- From content, the first ``<think>`` opens reasoning (text before it stays content);
  the first ``</think>`` after that closes it, and all the rest is content, verbatim
  (further tags included). Only one reasoning block.
- ``message.reasoning_content`` is the text between the tags; it is absent when the
  answer never reasoned. ``message.content`` is the text outside the tags (``""`` when
  everything was reasoning, e.g. cut by ``max_tokens`` inside the block).
- Streaming: each chunk's ``delta.content`` is split the same way into
  ``delta.reasoning_content`` and ``delta.content``; a text that could be the start of a
  tag (``<th``) is held back until the next chunk shows it is not, and flushed with the
  choice's finishing chunk. Concatenated deltas equal the non-streamed fields.
- ``usage.completion_tokens_details.reasoning_tokens``: per choice, the generated tokens
  up to and including the first ``</think>`` token after reasoning opened (all of them if
  it never came; 0 if reasoning never opened), summed over choices. Counted on token ids:
  a tag the model spelled out in pieces splits the text but is not counted as a tag.

Response fields (``MessageFields``, ``UsageFields``): ``reasoning_content`` on messages and
deltas, ``completion_tokens_details`` on usage; the server adds them without naming them.
Per-request state (one splitter per choice) lives in
``response.plugin_state["reasoning"]``.
The tags must reach the text, so a model whose ``<think>`` is a *special* token needs
``skip_special_tokens: false``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from freetoken_core import hookimpl
from freetoken_core.processors import (
    AnswerStart,
    Plugin,
    RequestView,
    ResponseFields,
    ResponseView,
)

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
STATE_KEY = "reasoning"
_BEFORE, _REASONING, _AFTER = 0, 1, 2


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Splits one choice's text, fed in pieces, into ``(reasoning, content)`` pieces.

    ``feed(text, final)`` returns the parts decided so far; with ``final`` nothing is held
    back. ``has_reasoned`` is true once a reasoning block was opened."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = _REASONING if in_reasoning else _BEFORE
        self.held = ""

    @property
    def has_reasoned(self) -> bool:
        return self.state != _BEFORE

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == _AFTER:
                content.append(text)
                break
            tag = OPEN_TAG if self.state == _BEFORE else CLOSE_TAG
            out = content if self.state == _BEFORE else reasoning
            at = text.find(tag)
            if at >= 0:
                out.append(text[:at])
                text = text[at + len(tag):]
                self.state += 1
                continue
            keep = 0 if final else _partial_tag(text, tag)
            out.append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)


def split(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """``(reasoning_content, content)`` of a whole answer; ``None`` when it never reasoned."""
    splitter = ThinkSplitter(in_reasoning)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.has_reasoned else None), content


def count_reasoning_tokens(token_ids: list[int], open_id: int, close_id: int,
                           in_reasoning: bool = False) -> int:
    """Generated tokens up to and including the ``</think>`` that closes reasoning."""
    if in_reasoning:
        start = 0
    elif open_id in token_ids:
        start = token_ids.index(open_id)
    else:
        return 0
    try:
        return token_ids.index(close_id, start) + 1
    except ValueError:
        return len(token_ids)


def _token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return None if token_id is None or token_id == tokenizer.unk_token_id else token_id


@dataclass
class _RequestState:
    open_id: int
    close_id: int
    in_reasoning: list[bool]
    """Per prompt: did the prompt leave a ``<think>`` open."""
    splitters: dict[int, ThinkSplitter] = field(default_factory=dict)


def _state(response: ResponseView) -> _RequestState | None:
    """This request's state, made on first use; ``None`` when the model has no tags."""
    if STATE_KEY in response.plugin_state:
        return response.plugin_state[STATE_KEY]
    open_id = _token_id(response.tokenizer, OPEN_TAG)
    close_id = _token_id(response.tokenizer, CLOSE_TAG)
    state = None
    if open_id is not None and close_id is not None:
        in_reasoning = [prompt_leaves_open(ids, open_id, close_id)
                        for ids in response.prompt_token_ids]
        state = _RequestState(open_id, close_id, in_reasoning)
    response.plugin_state[STATE_KEY] = state
    return state


def _starts_in_reasoning(state: _RequestState, response: ResponseView, index: int) -> bool:
    return state.in_reasoning[index // response.params.n]


def _reasoning_tokens(state: _RequestState, response: ResponseView) -> int:
    num_choices = len(response.prompt_token_ids) * response.params.n
    return sum(count_reasoning_tokens(response.token_ids(i), state.open_id, state.close_id,
                                      _starts_in_reasoning(state, response, i))
               for i in range(num_choices))


class CompletionTokensDetails(msgspec.Struct):
    """``usage.completion_tokens_details``, as OpenAI reports it."""

    reasoning_tokens: int = 0


def prompt_leaves_open(prompt_token_ids: Sequence[int], open_id: int, close_id: int) -> bool:
    """Whether the prompt's last ``<think>`` comes after its last ``</think>``."""
    last_open = max((i for i, t in enumerate(prompt_token_ids) if t == open_id), default=-1)
    last_close = max((i for i, t in enumerate(prompt_token_ids) if t == close_id), default=-1)
    return last_open > last_close


class Reasoning(Plugin):
    """Split <think>…</think> out of chat answers as reasoning_content, and count it."""

    @staticmethod
    @hookimpl
    def freetoken_answer_start(request: RequestView, tokenizer: Any) -> AnswerStart | None:
        """The answer of a chat sequence starts after ``</think>`` when the prompt left
        ``<think>`` open, or when the sequence opens it with its first token."""
        if not request.is_chat:
            return None
        open_id, close_id = _token_id(tokenizer, OPEN_TAG), _token_id(tokenizer, CLOSE_TAG)
        if open_id is None or close_id is None:
            return None
        inside = prompt_leaves_open(request.prompt_token_ids, open_id, close_id)
        return AnswerStart(close_id, inside, open_id)

    class MessageFields(ResponseFields):
        reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
        """The text between the tags; absent when the answer never reasoned."""

    class UsageFields(ResponseFields):
        completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET

    @staticmethod
    @hookimpl
    def freetoken_decorate_response(response: ResponseView) -> None:
        if response.route != "chat":
            return
        state = _state(response)
        if state is None:
            return
        for choice in response.choices:
            inside = _starts_in_reasoning(state, response, choice.index)
            if not response.is_chunk:
                reasoning, content = split(choice.text or "", inside)
                choice.text = content
                if reasoning is not None:
                    choice.message.reasoning_content = reasoning
                continue
            final = choice.finish_reason is not None
            if not choice.text and not final:
                continue
            splitter = state.splitters.get(choice.index)
            if splitter is None:
                splitter = state.splitters[choice.index] = ThinkSplitter(inside)
            reasoning, content = splitter.feed(choice.text or "", final)
            if reasoning:
                choice.message.reasoning_content = reasoning
            choice.text = content if content or not reasoning else None
        if response.usage is not None:
            response.usage.completion_tokens_details = CompletionTokensDetails(
                _reasoning_tokens(state, response))
