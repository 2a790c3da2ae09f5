"""msgspec Structs for the OpenAI-compatible request and response bodies.

Requests accept unknown fields at the schema level (real clients send them); the routes
then pass every field that is not declared here to ``SamplingParams`` as a plugin field,
so a field no enabled plugin owns is a 400 naming it (``PluginManager.validate``). Fields
that clients send and that we accept by design without effect are in ``IGNORED_FIELDS``.
Simple constraints live in the types; ``SamplingParams`` and the plugins check the rest.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from freetoken_core.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls"})
"""Accepted and without effect on generation (as in OpenAI's own server for these)."""

MAX_N = 16

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
PositiveInt = Annotated[int, Meta(ge=1)]
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
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
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
    # Declared so that they are refused by name until they are implemented.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a str, [str], [int] or [[int]]."""

    prompt: str | list[Any]
    logprobs: NumLogprobs | None = None
    """Top alternatives per token beside the sampled one (``None``: no logprobs)."""
    top_logprobs: Any = None  # a chat field: refused here by name
    echo: bool = False
    best_of: int | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A chat message. Unknown keys (``tool_calls``, ``tool_call_id``, …) are a 400: tools are
    not supported, and a key the template never sees must not be dropped silently."""

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


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET
    """Set by a plugin (``reasoning``); left out of the JSON otherwise."""


class CompletionLogprobs(msgspec.Struct):
    """The completions shape: one entry per generated token in each list; ``text_offset``
    is the token's character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


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


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: None = None


class ResponseMessage(msgspec.Struct):
    content: str
    role: str = "assistant"
    reasoning_content: str | UnsetType = UNSET
    """Set by the ``reasoning`` plugin when the answer reasoned; left out otherwise."""


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


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None


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
