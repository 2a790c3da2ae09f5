"""msgspec Structs for the OpenAI-compatible request and response bodies.

Requests accept unknown fields at the schema level (real clients send them); the routes
then pass every field that is not declared here to ``SamplingParams`` as a plugin field,
so a field no enabled plugin owns is a 400 naming it (``PluginManager.validate``). Fields
that clients send and that we accept by design without effect are in ``IGNORED_FIELDS``.
Simple constraints live in the types; ``SamplingParams`` and the plugins check the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from freetoken_core.plugins import PluginSelectionError
from freetoken_core.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

S = TypeVar("S", bound=msgspec.Struct)

IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier"})
"""Accepted and without effect on generation (as in OpenAI's own server for these)."""

MAX_N = 16

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
PositiveInt = Annotated[int, Meta(ge=1)]
NumTokens = Annotated[int, Meta(ge=0)]
"""``max_tokens``: 0 only to score the prompt (``echo`` or ``prompt_logprobs``), checked
by the routes."""
ChoiceCount = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
"""-1 (off) or >= 1; 0 and the vocabulary bound are checked by ``SamplingParams``."""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """Fields shared by both generation routes (core ``SamplingParams`` fields)."""

    model: str | None = None
    max_tokens: NumTokens | None = None
    max_completion_tokens: NumTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: ChoiceCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    """Prefix-cache isolation: only requests with the same salt share cached blocks."""
    prompt_logprobs: NumLogprobs | None = None
    """vLLM's extra: the prompt tokens' logprobs, ranks and this many alternatives."""


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a str, [str], [int] or [[int]]."""

    prompt: str | list[Any]
    logprobs: NumLogprobs | None = None
    """Top alternatives per token beside the sampled one (``None``: no logprobs)."""
    top_logprobs: Any = None  # a chat field: refused here by name
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens to a text prompt (the BOS a GGUF's
    ``add_bos_token`` or a tokenizer.json's post-processor asks for), as vLLM and
    llama-server do; token-id prompts are taken as they are."""


class ChatMessage(msgspec.Struct):
    """A chat message. Other keys are the enabled plugins' (``Plugin.ChatMessageFields``:
    an assistant's earlier tool calls, a tool result's call id); ``parse_body`` keeps them
    beside the message, and a key no enabled plugin owns is a 400 naming it."""

    role: str
    content: str | list[Any] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``: rendered through the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    """How many most likely alternatives per token; needs ``logprobs: true``."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Render the last (assistant) message open so the model continues it."""
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """Echoed as the response ``id`` (the engine keeps its own unique id)."""


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``/tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str


# -- responses -------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Plugins add fields (``UsageFields``): see ``ResponseTypes``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    """The completions shape: one entry per generated token in each list (with ``echo``,
    per prompt token first); ``text_offset`` is the token's character offset in the
    choice's text. The first token of an echoed prompt has no logprob: ``null`` in
    ``token_logprobs`` and ``top_logprobs``, as in OpenAI's legacy API."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(msgspec.Struct):
    """One token at one prompt position, as vLLM's ``Logprob``: ``rank`` 1 is the most
    likely token there; ``decoded_token`` is the token's text decoded alone."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobsList = list[dict[str, PromptTokenLogprob] | None]
"""vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per prompt token
the token and the asked-for alternatives, keyed by token id (as a string)."""


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    content: list[ChatTokenLogprob]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobsList | msgspec.UnsetType = msgspec.UNSET
    """Present only when the request asked for ``prompt_logprobs``."""


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: None = None


class ResponseMessage(msgspec.Struct):
    """Plugins add fields (``MessageFields``): see ``ResponseTypes``. ``content`` is
    ``null`` only when a plugin says so (a message that is all tool calls)."""

    content: str | None
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: None = None
    prompt_logprobs: PromptLogprobsList | msgspec.UnsetType = msgspec.UNSET
    """Present only when the request asked for ``prompt_logprobs``."""


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """Plugins add fields (``MessageFields``): see ``ResponseTypes``."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "freetoken"
    max_model_len: int | None = None
    generation_defaults: dict[str, Any] = {}
    """The values requests that leave a field unset get (``--generation-config``)."""
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class VersionResponse(msgspec.Struct):
    version: str


@dataclass(frozen=True)
class ResponseTypes:
    """The message, delta and usage Structs of this server: the ones above plus the
    response fields the enabled plugins declare (``Plugin.MessageFields`` on messages and
    deltas, ``Plugin.UsageFields`` on usage), so the server never names them. The routes
    build their responses with these; a container's annotation names the base class, and
    msgspec encodes the subclass's fields too."""

    message: type[ResponseMessage] = ResponseMessage
    delta: type[DeltaMessage] = DeltaMessage
    usage: type[Usage] = Usage

    @classmethod
    def build(cls, plugins: dict[str, type[Any]]) -> ResponseTypes:
        """Types for the enabled ``plugins`` (name → class); ``PluginSelectionError`` when two
        plugins, or a plugin and the server, declare the same response field."""
        return cls(_extended(ResponseMessage, plugins, "MessageFields"),
                   _extended(DeltaMessage, plugins, "MessageFields"),
                   _extended(Usage, plugins, "UsageFields"))


def _extended(base: type[S], plugins: dict[str, type[Any]], attr: str) -> type[S]:
    added: list[tuple[str, Any, Any]] = []
    owners: dict[str, str] = {}
    for name, plugin in sorted(plugins.items()):
        fields_cls = getattr(plugin, attr, None)
        if fields_cls is None:
            continue
        for info in msgspec.structs.fields(fields_cls):
            if info.name in base.__struct_fields__ or info.name in owners:
                other = owners.get(info.name, "the server")
                raise PluginSelectionError(f"plugins {name} and {other} both declare the "
                                           f"response field {info.name!r}")
            owners[info.name] = name
            added.append((info.name, info.type, info.default))
    if not added:
        return base
    return msgspec.defstruct(base.__name__, added, bases=(base,))  # type: ignore[return-value]
