"""From OpenAI request bodies to engine requests, and from engine updates to choices.

``parse_body`` turns raw JSON into a request Struct plus its undeclared fields;
``sampling_params`` builds and validates ``SamplingParams`` (plugin fields included);
``render_chat`` renders chat messages through the model's template (``generation.py``
runs the engine requests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import jinja2
import msgspec

from freetoken_core.engine.core import effective_max_tokens
from freetoken_core.engine.generation_defaults import GenerationDefaults
from freetoken_core.errors import InvalidRequest, param_of
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ChatView, ModelInfo
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.protocol import (
    IGNORED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from freetoken_core.tokenizer import apply_chat_template

T = TypeVar("T", bound=msgspec.Struct)

def _out_of_range_field(body: bytes) -> str | None:
    """The top-level field of ``body`` holding a number the decoder cannot represent, found
    by decoding the fields one at a time (only on that error path); ``None`` if not found."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return None
    for name, value in fields.items():
        try:
            msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError):
            return name
    return None


_MESSAGE_KEYS = frozenset(ChatMessage.__struct_fields__)


def _json_number(text: str) -> float | int:
    """A JSON number with a fraction or an exponent: an ``int`` when its float64 value is
    integral (JSON Schema's ``integer`` includes ``5.0`` and ``1e2``) and below 2**64 in
    magnitude (larger ones stay floats: as integers the engine could not carry them), else
    a ``float``; ``ValueError`` when no float64 holds it (``1e400``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number out of range")
    return int(value) if value.is_integer() and abs(value) < 2**64 else value


_DECODER = msgspec.json.Decoder(float_hook=_json_number)


def message_extras(request: Any, raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per message of ``request`` (a chat or tokenize request decoded from ``raw``), the
    keys it carries beyond ``ChatMessage``'s (plugin message fields, still unchecked)."""
    messages = getattr(request, "messages", None)
    if not messages:
        return []
    return [{k: v for k, v in m.items() if k not in _MESSAGE_KEYS}
            for m in raw["messages"]]


def parse_body(body: bytes, cls: type[T]
               ) -> tuple[T, dict[str, Any], list[dict[str, Any]] | None]:
    """Decode ``body`` as ``cls``; return it, the fields ``cls`` does not declare (minus
    ``IGNORED_FIELDS``), and the messages' own extra keys; an integral number written with a
    fraction or an exponent (``5.0``, ``1e2``) counts as an integer, as in JSON Schema.
    Raises ``InvalidRequest`` for bad JSON, types or constraints,
    including a number no float64 (or a 4,300-digit integer) holds, named by its field, and
    nesting deeper than the decoder recurses (about 1,000 levels). The third value holds,
    per chat message, its keys beyond ``ChatMessage``'s (plugin message fields, for
    ``render_chat``); ``None`` when no message has any, or ``cls`` has no messages."""
    try:
        raw = _DECODER.decode(body)
    except msgspec.ValidationError:  # well-formed JSON, but a number out of range
        field = _out_of_range_field(body)
        raise InvalidRequest(field, f"{field or 'the request body'} holds a number out of "
                                    f"range (it does not fit a float64)") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(None, "the request body is nested too deeply") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(None, "the request body must be a JSON object")
    try:
        request = msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(param_of(exc), str(exc)) from None
    except RecursionError:
        raise InvalidRequest(None, "the request body is nested too deeply") from None
    declared = set(cls.__struct_fields__)
    extra = {k: v for k, v in raw.items() if k not in declared and k not in IGNORED_FIELDS}
    extras = message_extras(request, raw)
    return request, extra, extras if any(extras) else None


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for OpenAI fields this server does not implement yet, rather than ignore them."""
    unsupported: dict[str, bool] = {}
    if isinstance(request, CompletionRequest):
        unsupported["top_logprobs"] = request.top_logprobs is not None
        unsupported["best_of"] = request.best_of not in (None, 1)
    for name, refused in unsupported.items():
        if refused:
            raise InvalidRequest(name, f"{name} is not supported by this server yet")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options", "stream_options needs stream: true")
    if (request.max_tokens is not None and request.max_completion_tokens is not None
            and request.max_tokens != request.max_completion_tokens):
        raise InvalidRequest("max_completion_tokens", "max_completion_tokens is an alias of "
                             "max_tokens: give one, or both with the same value")
    _check_scoring(request)
    if not isinstance(request, CompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true")
        if request.continue_final_message and request.add_generation_prompt:
            raise InvalidRequest("continue_final_message", "continue_final_message and "
                                 "add_generation_prompt cannot both be true")


def _check_scoring(request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for ``max_tokens`` 0 with nothing to return, and for ``prompt_logprobs`` with
    ``stream`` (as vLLM answers both)."""
    echo = isinstance(request, CompletionRequest) and request.echo
    for name in ("max_tokens", "max_completion_tokens"):
        if getattr(request, name) == 0 and request.prompt_logprobs is None and not echo:
            raise InvalidRequest(name, f"{name} must be at least 1: 0 generates nothing, "
                                 "which is only useful to score the prompt (with prompt_logprobs"
                                 ", or with echo on /v1/completions)")
    if request.prompt_logprobs is not None and request.stream:
        raise InvalidRequest("prompt_logprobs", "prompt_logprobs is not available with stream: "
                             "true (on /v1/completions, echo with logprobs streams the "
                             "prompt's logprobs)")


def engine_prompt_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The alternatives per prompt position the engine computes: ``prompt_logprobs``, and on
    completions with ``echo`` the ``logprobs`` of the echoed prompt tokens (the larger)."""
    wanted = [request.prompt_logprobs]
    if isinstance(request, CompletionRequest) and request.echo:
        wanted.append(request.logprobs)
    return max((n for n in wanted if n is not None), default=None)


def sampling_params(request: CompletionRequest | ChatCompletionRequest, extra: dict[str, Any],
                    plugins: PluginManager, model: ModelInfo,
                    defaults: GenerationDefaults | None = None) -> SamplingParams:
    """Validated ``SamplingParams``; undeclared fields go to the plugins (or a 400).
    The sampling fields the request leaves unset (``None``, or absent) take the generation
    ``defaults`` first, then the route's own default (``max_tokens``)."""
    _refuse_unsupported(request)
    max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                  else request.max_tokens)
    if isinstance(request, CompletionRequest):
        logprobs = request.logprobs
    else:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    route = "completions" if isinstance(request, CompletionRequest) else "chat"
    sampling = {"temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "max_tokens": max_tokens, "seed": request.seed,
                "stop": request.stop}
    params = SamplingParams(
        n=request.n, ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, logprobs=logprobs,
        prompt_logprobs=engine_prompt_logprobs(request), cache_salt=request.cache_salt,
        **{name: value for name, value in sampling.items() if value is not None}, **extra)
    # OpenAI's completions default; chat runs to the end of the context.
    fallback = {"max_tokens": 16 if route == "completions" else None}
    params = (defaults or GenerationDefaults()).apply(params, route, fallback)
    params.verify(model)
    plugins.validate(params, model, route)
    return params


def split_prompt(prompt: str | list[Any]) -> list[str | list[int]]:
    """``prompt`` as str, [str], [int] or [[int]] → one text or token list per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt", "prompt must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequest("prompt", "prompt must be a string, a list of strings, a list of "
                                   "token ids or a list of non-empty lists of token ids")


def completion_prompts(prompt: str | list[Any],
                       rewrite: Callable[[str | list[int]], str | list[int]],
                       encode: Callable[[str], list[int]]) -> list[list[int]]:
    """One token list per prompt; each prompt goes through ``rewrite`` (the
    ``freetoken_rewrite_prompt`` hook) before ``encode`` tokenizes it."""
    parts = [rewrite(part) for part in split_prompt(prompt)]
    return [encode(part) if isinstance(part, str) else list(part) for part in parts]


def chat_messages(messages: list[ChatMessage],
                  extras: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; text parts of a content list joined;
    ``extras[i]`` (plugin message fields, already typed) joins message ``i``."""
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
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if extras:
            entry.update(extras[i])
        rendered.append(entry)
    return rendered


RESERVED_TEMPLATE_KWARGS = frozenset({
    # Arguments of transformers' ``apply_chat_template`` / ``render_jinja_template``: they
    # change how the template is applied, not what it renders.
    "conversation", "conversations", "messages", "tokenize", "add_generation_prompt",
    "continue_final_message", "chat_template", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "sanitize_control_tokens",
    # A template input with a meaning of its own that no request field sets. (Request
    # fields, plugin fields included, are refused too: see ``render_chat``.)
    "documents",
    # Globals of the template environment.
    "raise_exception", "strftime_now", "dict", "namespace",
    # Filled from the tokenizer's special tokens.
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens"})
"""Keys ``chat_template_kwargs`` may not set (a 400 naming them)."""


def render_chat(tokenizer: Any, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None,
                plugins: PluginManager | None = None, params: SamplingParams | None = None,
                extras: list[dict[str, Any]] | None = None) -> str:
    """The chat prompt text. ``continue_final_message`` leaves the last message, which must
    be the assistant's, open for the model to continue. ``chat_template_kwargs`` become
    template variables; a key that would change how the template is applied (rather than
    what it renders), or that is a request field of an enabled plugin, is a 400, as is a
    template that fails on these messages. ``extras`` are the messages' plugin keys
    (``parse_body``'s third value), checked here by ``plugins``, whose
    ``freetoken_chat_template`` hooks then adapt messages and variables for the template
    (``params``: the validated request; ``None`` on ``/tokenize``)."""
    kwargs = dict(chat_template_kwargs or {})
    fields = set(plugins.field_owners()) if plugins else set()
    refused = sorted((RESERVED_TEMPLATE_KWARGS | fields) & kwargs.keys())
    if refused:
        as_fields = [name for name in refused if name in fields]
        hint = (f" ({', '.join(as_fields)}: a request field, sent at the top level of the "
                f"body)" if as_fields else "")
        raise InvalidRequest("chat_template_kwargs",
                             f"chat_template_kwargs cannot set {', '.join(refused)}{hint}")
    if continue_final_message and messages[-1].role != "assistant":
        raise InvalidRequest("continue_final_message", "continue_final_message needs the "
                             "last message to be the assistant's")
    typed: list[dict[str, Any]] | None = None
    if extras and any(extras):
        if plugins is None:
            key = next(k for e in extras for k in e)
            raise InvalidRequest(f"messages[{next(i for i, e in enumerate(extras) if e)}]."
                                 f"{key}", f"unknown message field {key!r}")
        typed = [plugins.message_fields(i, e) if e else {} for i, e in enumerate(extras)]
    rendered = chat_messages(messages, typed)
    if plugins is not None:
        plugins.prepare_chat(ChatView(rendered, kwargs,
                                      getattr(tokenizer, "chat_template", None) or "",
                                      tokenizer, params))
    try:
        return apply_chat_template(tokenizer, rendered,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise InvalidRequest("messages", f"the chat template failed on these messages: "
                                         f"{exc}") from None
    except RecursionError:  # messages are flat: only chat_template_kwargs can nest
        raise InvalidRequest("chat_template_kwargs", "chat_template_kwargs is nested too "
                                                     "deeply") from None


def check_fits(prompts: list[list[int]], params: SamplingParams, model: ModelInfo,
               prompt_param: str = "prompt") -> None:
    """400 when ids are bad, or when a prompt plus ``max_tokens`` does not fit the context
    (code ``context_length_exceeded``; a too-long prompt is named ``prompt_param``:
    ``messages`` on the chat route, as OpenAI does)."""
    for token_ids in prompts:
        if any(not 0 <= t < model.vocab_size for t in token_ids):
            raise InvalidRequest("prompt", f"prompt token ids must be in [0, {model.vocab_size})")
        try:
            effective_max_tokens(len(token_ids), params, model.max_model_len)
        except InvalidRequest as exc:
            if exc.param == "prompt":
                exc.param = prompt_param
            raise
