"""From OpenAI request bodies to engine requests, and from engine updates to choices.

``parse_body`` turns raw JSON into a request Struct plus its undeclared fields;
``sampling_params`` builds and validates ``SamplingParams`` (plugin fields included);
``Generation`` runs one HTTP request's prompts × ``n`` choices through the engine,
detokenizing and matching stop strings here in the server process.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from freetoken_core.engine.core import effective_max_tokens
from freetoken_core.engine.output_processor import ChoiceText
from freetoken_core.errors import InvalidRequest
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.engine_client import EngineClient
from freetoken_core.server.protocol import (
    IGNORED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)

T = TypeVar("T", bound=msgspec.Struct)

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _param_of(error: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error is about: ``max_tokens``, ``messages[0].role``."""
    text = str(error)
    path = _PATH.search(text)
    missing = _MISSING.search(text)
    parts = [p for p in (path.group(1) if path else "", missing.group(1) if missing else "") if p]
    return ".".join(parts) or None


def parse_body(body: bytes, cls: type[T]) -> tuple[T, dict[str, Any]]:
    """Decode ``body`` as ``cls``; return it and the fields ``cls`` does not declare (minus
    ``IGNORED_FIELDS``). Raises ``InvalidRequest`` for bad JSON, types or constraints."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(None, "the request body must be a JSON object")
    try:
        request = msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_param_of(exc), str(exc)) from None
    declared = set(cls.__struct_fields__)
    extra = {k: v for k, v in raw.items() if k not in declared and k not in IGNORED_FIELDS}
    return request, extra


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for OpenAI fields this server does not implement yet, rather than ignore them."""
    unsupported = {
        "logprobs": request.logprobs not in (None, False),
        "top_logprobs": request.top_logprobs is not None,
        "response_format": request.response_format not in (None, {"type": "text"}),
        "tools": bool(request.tools),
        "functions": bool(request.functions),
        "tool_choice": request.tool_choice not in (None, "none"),
    }
    if isinstance(request, CompletionRequest):
        unsupported["echo"] = request.echo
        unsupported["suffix"] = request.suffix is not None
        unsupported["best_of"] = request.best_of not in (None, 1)
    for name, refused in unsupported.items():
        if refused:
            raise InvalidRequest(name, f"{name} is not supported by this server yet")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options", "stream_options needs stream: true")


def sampling_params(request: CompletionRequest | ChatCompletionRequest, extra: dict[str, Any],
                    plugins: PluginManager, model: ModelInfo) -> SamplingParams:
    """Validated ``SamplingParams``; undeclared fields go to the plugins (or a 400)."""
    _refuse_unsupported(request)
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is None and isinstance(request, CompletionRequest):
        max_tokens = 16  # OpenAI's completions default; chat runs to the end of the context
    params = SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        max_tokens=max_tokens, seed=request.seed, stop=request.stop or [],
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, **extra)
    plugins.validate(params, model)
    return params


def encode(tokenizer: Any, text: str) -> list[int]:
    """The engine's tokenization of a rendered prompt (no special tokens added)."""
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompts(tokenizer: Any, prompt: str | list[Any]) -> list[list[int]]:
    """``prompt`` as str, [str], [int] or [[int]] → one token list per prompt."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt)]
    if not prompt:
        raise InvalidRequest("prompt", "prompt must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode(tokenizer, p) for p in prompt]
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequest("prompt", "prompt must be a string, a list of strings, a list of "
                                   "token ids or a list of non-empty lists of token ids")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; text parts of a content list joined."""
    rendered = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequest(f"messages[{i}].content",
                                         "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        rendered.append({"role": message.role, "content": content or ""})
    return rendered


def check_fits(prompts: list[list[int]], params: SamplingParams, model: ModelInfo) -> None:
    """400 when a prompt plus ``max_tokens`` does not fit the context, or ids are bad."""
    for token_ids in prompts:
        if any(not 0 <= t < model.vocab_size for t in token_ids):
            raise InvalidRequest("prompt", f"prompt token ids must be in [0, {model.vocab_size})")
        effective_max_tokens(len(token_ids), params, model.max_model_len)


@dataclass
class ChoiceDelta:
    """New text of one choice; ``finish_reason`` is set exactly once per choice."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Choice:
    text: ChoiceText
    num_tokens: int = 0
    num_sent: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Generation:
    """One HTTP request's run: every prompt × ``n`` choices, submitted together.

    Choice ``index`` is ``prompt_index * n + choice``. Iterate ``deltas()`` once; when it
    ends normally every choice has its finish reason and ``usage()`` is final.
    """

    client: EngineClient
    tokenizer: Any
    prompts: list[list[int]]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))
    _choices: list[list[_Choice]] = field(init=False)
    _num_cached: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._choices = [[_Choice(ChoiceText(self.tokenizer, ids, self.params))
                          for _ in range(self.params.n)] for ids in self.prompts]
        self._num_cached = [0] * len(self.prompts)

    def _engine_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas as tokens arrive; stops the engine's choice when a stop string hits."""
        index_of = {self._engine_id(i): i for i in range(len(self.prompts))}
        num_open = len(self.prompts) * self.params.n
        updates = self.client.generate(
            [(self._engine_id(i), ids) for i, ids in enumerate(self.prompts)], self.params)
        try:
            async for update in updates:
                p = index_of[update.request_id]
                choice = self._choices[p][update.index]
                if choice.finish_reason is not None:
                    continue  # a token drawn before the engine saw our stop_sequence
                self._num_cached[p] = max(self._num_cached[p], update.num_cached_tokens)
                choice.num_tokens += 1
                matched = choice.text.add(update.token_id, update.finish_reason is not None)
                if matched is not None:
                    choice.finish_reason, choice.stop_reason = "stop", matched
                    if update.finish_reason is None:
                        self.client.stop_sequence(update.request_id, update.index, matched)
                elif update.finish_reason is not None:
                    choice.finish_reason = update.finish_reason
                    choice.stop_reason = update.stop_reason
                new_text = choice.text.released[choice.num_sent:]
                choice.num_sent = len(choice.text.released)
                if choice.finish_reason is not None:
                    num_open -= 1
                if new_text or choice.finish_reason is not None:
                    yield ChoiceDelta(p * self.params.n + update.index, new_text,
                                      choice.finish_reason, choice.stop_reason)
                if num_open == 0:
                    break
        finally:
            await updates.aclose()

    def texts(self) -> list[str]:
        return [c.text.released for choices in self._choices for c in choices]

    def finishes(self) -> list[tuple[str | None, int | str | None]]:
        return [(c.finish_reason, c.stop_reason) for choices in self._choices for c in choices]

    def usage(self) -> Usage:
        """Prompts counted once each (not per choice); completions summed over choices."""
        num_prompt = sum(len(ids) for ids in self.prompts)
        num_completion = sum(c.num_tokens for choices in self._choices for c in choices)
        return Usage(num_prompt, num_completion, num_prompt + num_completion,
                     PromptTokensDetails(sum(self._num_cached)))
