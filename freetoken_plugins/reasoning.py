"""The reasoning plugin: split a chat answer's reasoning out as ``reasoning_content`` and
count it; pass ``reasoning_effort`` to the chat template.

Switch: no request field. Like vLLM's ``--reasoning-parser``, the split is on for every
``POST /v1/chat/completions`` while the plugin is enabled and the model's vocabulary has one
of the three formats as whole tokens: harmony's ``<|channel|>``, ``<|message|>``,
``<|end|>`` and ``<|start|>`` (OpenAI's gpt-oss), Gemma 4's ``<|channel>`` and
``<channel|>``, or ``<think>`` and ``</think>`` (Qwen3, DeepSeek-R1 and the test tokenizer),
in that order when a vocabulary has several; SmolLM2 has none, so there it does nothing. Turn it off with ``--plugins`` without ``reasoning``.
Completions are never touched.

``<think>`` semantics, per choice, on the generated text (``ThinkSplitter``):

- The answer starts *inside* reasoning when the prompt left a ``<think>`` open (its last
  ``<think>`` token comes after its last ``</think>``, as templates that open the block
  for the model do); otherwise it starts in content.
- From content, the first ``<think>`` opens reasoning (text before it stays content);
  the first ``</think>`` after that closes it, and all the rest is content, verbatim
  (further tags included). Only one reasoning block.
- ``usage.completion_tokens_details.reasoning_tokens``: per choice, the generated tokens
  up to and including the first ``</think>`` token after reasoning opened (all of them if
  it never came; 0 if reasoning never opened), summed over choices. Counted on token ids:
  a tag the model spelled out in pieces splits the text but is not counted as a tag.
- The tags must reach the text, so a model whose ``<think>`` is a *special* token needs
  ``skip_special_tokens: false``.

Harmony semantics (``freetoken_plugins.harmony``, which is the reference):

- The body of each analysis-channel message is reasoning; the body of each final or
  commentary message, and text written without any channel header, is content; headers,
  ``<|end|>`` / ``<|return|>`` / ``<|call|>`` and every other special token are in
  neither. A message addressed to a recipient (``to=functions.get_weather``, a call) stays
  in the content raw, markup included, for the tool_calls plugin (its ``harmony`` family)
  to turn into ``tool_calls``; without tools in the request it comes back that way.
- The markup is special tokens, so for chat requests on such a vocabulary the plugin
  decodes the answer with them (it sets ``skip_special_tokens`` false in
  ``freetoken_chat_template``) and the split removes them all: a request's own
  ``skip_special_tokens`` does not change a harmony chat answer.
- ``reasoning_tokens``: per choice, the tokens of its analysis messages, each from the
  first token of its header to its ``<|end|>``.
- Where the prompt leaves the answer (after ``<|start|>assistant``; inside a channel
  header or a message body it opened) is read from the prompt's text after its last
  ``<|start|>``.

Gemma 4 semantics (``freetoken_plugins.gemma4``, which is the reference): the text of each
``<|channel>thought`` … ``<channel|>`` block is reasoning (the whitespace after ``thought``
dropped), the rest is content; a prompt that closed an empty thought channel
(``enable_thinking`` false) leaves the answer in content, one whose last ``<|channel>`` is
open leaves it in reasoning. The chat answer is decoded with its special tokens (as for
harmony): the tool-call markup (``<|tool_call>``, ``<tool_call|>``, ``<|"|>``) stays, for the
tool_calls plugin's ``gemma4`` family; every other special token (``<turn|>``,
``<|tool_response>`` …) is dropped. ``reasoning_tokens``: the tokens of each thought block,
from its ``<|channel>`` to its ``<channel|>``.

All formats: ``message.reasoning_content`` is the reasoning, absent when the answer never
reasoned; ``message.content`` is the rest (``""`` when everything was reasoning, e.g. cut
by ``max_tokens``). Streaming: each chunk's ``delta.content`` is split the same way into
``delta.reasoning_content`` and ``delta.content``; text that could be the start of a tag
or a marker (``<th``, ``<|cha``) is held back until the next chunk shows what it is, and
flushed with the choice's finishing chunk. Concatenated deltas equal the non-streamed
fields.

History (the plugin's message keys, ``ChatMessageFields``): an assistant message may carry
an earlier answer's reasoning back, as ``reasoning_content`` (what this plugin returns, as
DeepSeek, llama.cpp's server and vLLM before 0.11 do) or ``reasoning`` (vLLM's newer name),
a string or ``null`` (``null``: as if absent). Clients send it back as they got it: the
official ``openai`` client's ``messages.append(response.choices[0].message)``, agent loops
around tool calls. The template receives the text under three keys of the message, the
names templates read it by: ``reasoning_content`` (Qwen3's writes ``<think>…</think>`` for
the assistant turns after the last user message), ``reasoning`` (vLLM hands both) and
``thinking`` (gpt-oss's writes it as the analysis message before a tool call; recent
transformers fills ``thinking`` from the other two itself). A template that reads none of
them renders nothing of it; the field is still accepted, as vLLM and llama.cpp do. 400s,
naming ``messages[i].<key>``: a value that is not a string, the key on a message that is
not the assistant's, and ``reasoning`` and ``reasoning_content`` that differ on one message
(the same text twice, as vLLM's responses carry it, is one reasoning). The keys are checked
before any other plugin adapts the messages (``tryfirst``): ``tool_calls`` may merge tool
messages into new user messages, which would drop the key and shift the indices.

``reasoning_effort`` (the plugin's request field, chat only): ``low``, ``medium`` or
``high`` (else a 400 naming it), handed to the chat template as its ``reasoning_effort``
variable in ``freetoken_chat_template``; a template that does not read that variable is a
400 naming the field rather than an effort silently ignored. (``chat_template_kwargs``
cannot set it: a request field is sent at the top level.)

Response fields (``MessageFields``, ``UsageFields``): ``reasoning_content`` on messages and
deltas, ``completion_tokens_details`` on usage; the server adds them without naming them.
Per-request state (the format, one splitter per streamed choice) lives in
``response.plugin_state["reasoning"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Literal, Protocol

import jinja2
import jinja2.meta
import msgspec

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import (
    AnswerStart,
    ChatView,
    Plugin,
    RequestFields,
    RequestView,
    ResponseFields,
    ResponseView,
)
from freetoken_plugins import gemma4, harmony

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


def harmony_marker_ids(tokenizer: Any) -> dict[str, int] | None:
    """The harmony markers the vocabulary has as whole tokens → their ids; ``None`` unless
    it has all of ``harmony.REQUIRED_TOKENS``."""
    ids = {marker: _token_id(tokenizer, marker) for marker in sorted(harmony.MARKERS)}
    if any(ids[marker] is None for marker in harmony.REQUIRED_TOKENS):
        return None
    return {marker: i for marker, i in ids.items() if i is not None}


@lru_cache(maxsize=4)
def special_texts(tokenizer: Any) -> frozenset[str]:
    """The texts of the vocabulary's special tokens (markup in a harmony answer)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(token.content for token in decoder.values() if getattr(token, "special", False))
    return frozenset(texts | harmony.MARKERS)


@lru_cache(maxsize=64)
def template_reads(template: str, variable: str) -> bool:
    """Whether the chat template ``template`` reads the variable ``variable``."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return variable in template
    return variable in jinja2.meta.find_undeclared_variables(parsed)


HISTORY_KEYS = ("reasoning_content", "reasoning")
"""The message keys an earlier answer's reasoning comes back under, as clients send it."""
TEMPLATE_KEYS = ("reasoning_content", "reasoning", "thinking")
"""The message keys chat templates read it from: Qwen3's and most others'
``reasoning_content``, vLLM's ``reasoning``, gpt-oss's ``thinking``."""


def hand_history(messages: list[dict[str, Any]]) -> None:
    """Each message's earlier reasoning under every one of ``TEMPLATE_KEYS``, in place (a
    template reads the one it knows; recent transformers fills ``thinking`` itself too).
    Raises ``InvalidRequest`` for a key on a message that is not the assistant's, and for
    ``reasoning`` and ``reasoning_content`` that differ (both named ``messages[i].key``)."""
    for i, message in enumerate(messages):
        sent = {key: message.pop(key) for key in HISTORY_KEYS if key in message}
        if not sent:
            continue
        if message["role"] != "assistant":
            key = next(iter(sent))
            raise InvalidRequest(f"messages[{i}].{key}", f"only assistant messages carry "
                                 f"{key} (the reasoning of an earlier answer)")
        if len(set(sent.values())) > 1:
            raise InvalidRequest(f"messages[{i}].reasoning", "reasoning and "
                                 "reasoning_content are two names for one text and differ "
                                 "here: send one")
        message.update(dict.fromkeys(TEMPLATE_KEYS, next(iter(sent.values()))))


class _Splitter(Protocol):
    has_reasoned: bool

    def feed(self, text: str, final: bool = False) -> tuple[str, str]: ...


class _Think:
    """The ``<think>`` tags of one request's prompts."""

    def __init__(self, open_id: int, close_id: int, prompts: list[list[int]]) -> None:
        self.open_id, self.close_id = open_id, close_id
        self.in_reasoning = [prompt_leaves_open(ids, open_id, close_id) for ids in prompts]
        """Per prompt: did the prompt leave a ``<think>`` open."""

    def splitter(self, prompt_index: int) -> _Splitter:
        return ThinkSplitter(self.in_reasoning[prompt_index])

    def reasoning_tokens(self, token_ids: list[int], prompt_index: int) -> int:
        return count_reasoning_tokens(token_ids, self.open_id, self.close_id,
                                      self.in_reasoning[prompt_index])


def gemma4_channel_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of Gemma 4's ``<|channel>`` and ``<channel|>``; ``None`` unless the vocabulary
    has both as whole tokens."""
    ids = (_token_id(tokenizer, gemma4.CHANNEL_OPEN), _token_id(tokenizer, gemma4.CHANNEL_CLOSE))
    return None if None in ids else (ids[0], ids[1])  # type: ignore[return-value]


@dataclass
class _RequestState:
    format: _Think | harmony.HarmonyFormat | gemma4.Gemma4Format
    splitters: dict[int, _Splitter] = field(default_factory=dict)


def _state(response: ResponseView) -> _RequestState | None:
    """This request's state, made on first use; ``None`` when the model has neither the
    harmony markers nor the ``<think>`` tags."""
    if STATE_KEY in response.plugin_state:
        return response.plugin_state[STATE_KEY]
    tokenizer, prompts = response.tokenizer, response.prompt_token_ids
    state = None
    marker_ids = harmony_marker_ids(tokenizer)
    open_id, close_id = _token_id(tokenizer, OPEN_TAG), _token_id(tokenizer, CLOSE_TAG)
    channel_ids = gemma4_channel_ids(tokenizer)
    if marker_ids is not None:
        state = _RequestState(harmony.HarmonyFormat(
            partial(tokenizer.decode, skip_special_tokens=False),
            special_texts(tokenizer).__contains__, marker_ids, prompts))
    elif channel_ids is not None:
        state = _RequestState(gemma4.Gemma4Format(
            partial(tokenizer.decode, skip_special_tokens=False), *channel_ids,
            special_texts(tokenizer), prompts))
    elif open_id is not None and close_id is not None:
        state = _RequestState(_Think(open_id, close_id, prompts))
    response.plugin_state[STATE_KEY] = state
    return state


def _reasoning_tokens(state: _RequestState, response: ResponseView) -> int:
    num_choices = len(response.prompt_token_ids) * response.params.n
    return sum(state.format.reasoning_tokens(response.token_ids(i), i // response.params.n)
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
    """Split the reasoning out of chat answers (<think> tags, harmony's analysis channel,
    Gemma 4's thought channel) as reasoning_content, count it, take it back on earlier
    assistant messages, and pass reasoning_effort to the chat template."""

    routes = frozenset({"chat"})

    class Fields(RequestFields):
        reasoning_effort: Literal["low", "medium", "high"] | None = None
        """How much the model reasons before it answers: low, medium or high, handed to the
        chat template as its reasoning_effort variable (gpt-oss: the system message's
        "Reasoning:" line). A 400 on a model whose chat template does not read it."""

    class ChatMessageFields(RequestFields):
        reasoning_content: str | None = None
        """On an assistant message: the reasoning of that earlier answer, as this plugin
        returned it; handed to the chat template as the message's reasoning_content,
        reasoning and thinking (Qwen3's renders it in <think> tags, gpt-oss's as the
        analysis message before a tool call); a template that reads none of them renders
        nothing of it."""
        reasoning: str | None = None
        """vLLM's newer name for reasoning_content: send either (both: the same text)."""

    class MessageFields(ResponseFields):
        reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
        """The reasoning: the text between <think> and </think>, the answer's analysis
        channel (harmony) or its thought channel (Gemma 4); absent when the answer never
        reasoned."""

    class UsageFields(ResponseFields):
        completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET

    @staticmethod
    @hookimpl(tryfirst=True)
    def freetoken_chat_template(chat: ChatView) -> None:
        """Earlier answers' reasoning goes to the template under the keys templates read
        (``hand_history``; first, while the messages are still those the client sent);
        ``reasoning_effort`` becomes the template variable (a 400 when the template does
        not read it); on a harmony vocabulary the answer keeps its special tokens, which
        the split reads (and removes)."""
        hand_history(chat.messages)
        if chat.params is None:
            return
        fields = chat.params.fields.get(STATE_KEY)
        if fields is not None and fields.reasoning_effort is not None:
            if not template_reads(chat.template, "reasoning_effort"):
                raise InvalidRequest("reasoning_effort", "this model's chat template does not "
                                     "read reasoning_effort, so the model cannot be told how "
                                     "much to reason")
            chat.variables["reasoning_effort"] = fields.reasoning_effort
        if (harmony_marker_ids(chat.tokenizer) is not None
                or gemma4_channel_ids(chat.tokenizer) is not None):
            chat.params.skip_special_tokens = False

    @staticmethod
    @hookimpl
    def freetoken_answer_start(request: RequestView, tokenizer: Any) -> AnswerStart | None:
        """The answer of a chat sequence starts after ``</think>`` (Gemma 4: ``<channel|>``)
        when the prompt left ``<think>`` (``<|channel>``) open, or when the sequence opens
        it with its first token."""
        if not request.is_chat:
            return None
        open_id, close_id = (gemma4_channel_ids(tokenizer)
                             or (_token_id(tokenizer, OPEN_TAG), _token_id(tokenizer, CLOSE_TAG)))
        if open_id is None or close_id is None:
            return None
        inside = prompt_leaves_open(request.prompt_token_ids, open_id, close_id)
        return AnswerStart(close_id, inside, open_id)

    @staticmethod
    @hookimpl
    def freetoken_decorate_response(response: ResponseView) -> None:
        if response.route != "chat":
            return
        state = _state(response)
        if state is None:
            return
        for choice in response.choices:
            prompt_index = choice.index // response.params.n
            if not response.is_chunk:
                splitter = state.format.splitter(prompt_index)
                reasoning, content = splitter.feed(choice.text or "", final=True)
                choice.text = content
                if splitter.has_reasoned:
                    choice.message.reasoning_content = reasoning
                continue
            final = choice.finish_reason is not None
            if not choice.text and not final:
                continue
            splitter = state.splitters.get(choice.index)
            if splitter is None:
                splitter = state.splitters[choice.index] = state.format.splitter(prompt_index)
            reasoning, content = splitter.feed(choice.text or "", final)
            if reasoning:
                choice.message.reasoning_content = reasoning
            choice.text = content if content or not reasoning else None
        if response.usage is not None:
            response.usage.completion_tokens_details = CompletionTokensDetails(
                _reasoning_tokens(state, response))
