"""The Litestar app of ``freetoken serve``: routes, start-up and the error handler.

``create_app(config)`` returns an app whose start-up spawns the engine process and whose
shutdown stops it. Until the model is loaded ``/health`` answers 503 and the generation
routes 503; every error is rendered as ``{"error": {"message", "type", "param", "code"}}``
(``InvalidRequest`` and any schema failure → 400, unknown model or route → 404).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.response import ServerSentEvent

from freetoken_core.config import EngineConfig
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.models.resolve import DEFAULT_MODEL_NAME
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.server import protocol as p
from freetoken_core.server.engine_client import EngineClient, EngineDeadError
from freetoken_core.server.serving import (
    Generation,
    chat_messages,
    check_fits,
    completion_prompts,
    encode,
    parse_body,
    sampling_params,
)
from freetoken_core.tokenizer import apply_chat_template, load_tokenizer

log = logging.getLogger("freetoken.server")


@dataclass(frozen=True)
class ServerConfig:
    """What ``freetoken serve`` was asked to serve; ``served_model_name`` is the ``model``
    clients name (default: the ``--model`` argument, or the embedded model's name)."""

    engine: EngineConfig
    served_model_name: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME


class ApiError(FreeTokenError):
    """An error with its HTTP status and OpenAI ``type`` / ``code``."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)


@dataclass
class Serving:
    """What the routes share, filled in once the engine reports ``Ready``."""

    config: ServerConfig
    client: EngineClient
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None
    plugins: PluginManager | None = None
    model_info: ModelInfo | None = None

    @property
    def is_ready(self) -> bool:
        return self.model_info is not None and self.client.ready

    def require_ready(self, model: str | None = None) -> tuple[Any, PluginManager, ModelInfo]:
        if not self.is_ready:
            raise ApiError(503, self.client.dead_message or "the model is still loading",
                           "service_unavailable")
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "invalid_request_error",
                           "model_not_found", "model")
        assert self.plugins is not None and self.model_info is not None
        return self.tokenizer, self.plugins, self.model_info

    async def load(self, on_fatal: Callable[[str], None]) -> None:
        """Wait for the engine, then load the tokenizer and the plugins for validation."""
        try:
            info = await self.client.wait_ready()
        except EngineDeadError:
            return  # already reported through the client's on_dead
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, Path(info.model_dir))
            plugins = PluginManager(self.config.engine.plugins)
            plugins.enabled  # noqa: B018 (loads the plugins now, not on the first request)
            self.plugins = plugins
            self.model_info = ModelInfo(info.vocab_size, info.eos_token_ids, info.max_model_len)
        except FreeTokenError as exc:
            on_fatal(str(exc))


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | int | None = None) -> Response:
    body = p.ErrorResponse(p.ErrorBody(message, type_, param, code))
    return Response(content=body, status_code=status)


def _handle(request: Request, exc: Exception) -> Response:
    if isinstance(exc, InvalidRequest):
        return _error(400, exc.message, "invalid_request_error", exc.param)
    if isinstance(exc, ApiError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, EngineDeadError):
        return _error(503, str(exc), "service_unavailable")
    if isinstance(exc, ValidationException):
        return _error(400, str(exc.detail), "invalid_request_error")
    if isinstance(exc, NotFoundException):
        return _error(404, str(exc.detail), "not_found_error")
    if isinstance(exc, HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


def _sse(data: msgspec.Struct | str) -> str:
    return data if isinstance(data, str) else msgspec.json.encode(data).decode()


async def _stream(gen: Generation, first: Any, deltas: AsyncIterator[Any],
                  chunk: Callable[[list[Any], p.Usage | None], msgspec.Struct],
                  choice: Callable[[Any], Any], include_usage: bool,
                  opening: list[Any]) -> AsyncIterator[str]:
    """The SSE body; ``deltas`` is closed (and the engine request aborted) on disconnect."""
    try:
        if opening:
            yield _sse(chunk(opening, None))
        if first is not None:
            yield _sse(chunk([choice(first)], None))
        async for delta in deltas:
            yield _sse(chunk([choice(delta)], None))
        if include_usage:
            yield _sse(chunk([], gen.usage()))
    except FreeTokenError as exc:
        param = exc.param if isinstance(exc, InvalidRequest) else None
        yield _sse(p.ErrorResponse(p.ErrorBody(str(exc), "server_error", param)))
    finally:
        await deltas.aclose()
    yield "[DONE]"


async def _run(serving: Serving, request: Request, chat: bool) -> Any:
    cls = p.ChatCompletionRequest if chat else p.CompletionRequest
    body, extra = parse_body(await request.body(), cls)
    tokenizer, plugins, model_info = serving.require_ready(body.model)
    params = sampling_params(body, extra, plugins, model_info)
    if chat:
        text = apply_chat_template(tokenizer, chat_messages(body.messages),
                                   add_generation_prompt=body.add_generation_prompt)
        prompts = [encode(tokenizer, text)]
    else:
        prompts = completion_prompts(tokenizer, body.prompt)
    check_fits(prompts, params, model_info)
    gen = Generation(serving.client, tokenizer, prompts, params)
    prefix = "chatcmpl-" if chat else "cmpl-"
    rid, created, name = prefix + gen.request_id, int(time.time()), serving.config.model_name
    if chat:
        def chunk(choices: list[Any], usage: p.Usage | None) -> msgspec.Struct:
            return p.ChatCompletionChunk(rid, created, name, choices, usage)

        def choice(d: Any) -> Any:
            return p.ChatChunkChoice(d.index, p.DeltaMessage(content=d.text), d.finish_reason,
                                     d.stop_reason)
    else:
        def chunk(choices: list[Any], usage: p.Usage | None) -> msgspec.Struct:
            return p.CompletionResponse(rid, created, name, choices, usage)

        def choice(d: Any) -> Any:
            return p.CompletionChoice(d.index, d.text, d.finish_reason, d.stop_reason)

    deltas = gen.deltas()
    if body.stream:
        # The first delta is awaited here so that an engine refusal is still a plain 400.
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise
        opening = ([p.ChatChunkChoice(i, p.DeltaMessage(role="assistant", content=""))
                    for i in range(len(prompts) * params.n)] if chat else [])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ServerSentEvent(_stream(gen, first, deltas, chunk, choice,
                                       include_usage, opening))
    async for _ in deltas:
        pass
    finishes = gen.finishes()
    if chat:
        choices = [p.ChatChoice(i, p.ResponseMessage(t), *finishes[i])
                   for i, t in enumerate(gen.texts())]
        return p.ChatCompletionResponse(rid, created, name, choices, gen.usage())
    choices = [p.CompletionChoice(i, t, *finishes[i]) for i, t in enumerate(gen.texts())]
    return p.CompletionResponse(rid, created, name, choices, gen.usage())


def create_app(config: ServerConfig, client: EngineClient | None = None,
               on_fatal: Callable[[str], None] | None = None) -> Litestar:
    """The app; ``on_fatal(message)`` runs when the engine fails to load or dies (the
    default prints the message and leaves the server up, answering 503)."""

    def fatal(message: str) -> None:
        print(f"freetoken: error: {message}", file=sys.stderr, flush=True)
        if on_fatal is not None:
            on_fatal(message)

    serving = Serving(config, client or EngineClient(config.engine, on_dead=fatal))
    tasks: set[asyncio.Task[None]] = set()

    async def startup() -> None:
        serving.client.start()
        task = asyncio.create_task(serving.load(fatal))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def shutdown() -> None:
        await asyncio.to_thread(serving.client.shutdown)

    @get("/health", sync_to_thread=False)
    def health() -> Response:
        if not serving.is_ready:
            return _error(503, serving.client.dead_message or "the model is still loading",
                          "service_unavailable")
        return Response(content=b"", status_code=200)

    @get("/internal/stats")
    async def stats() -> p.EngineStats:
        serving.require_ready()
        s = await serving.client.stats()
        return p.EngineStats(s.num_running, s.num_waiting, s.num_requests,
                             s.num_used_kv_blocks, s.num_kv_blocks, s.num_aborted_requests)

    @get("/v1/models", sync_to_thread=False)
    def models() -> p.ModelList:
        serving.require_ready()
        assert serving.model_info is not None
        return p.ModelList([p.ModelCard(config.model_name, serving.created,
                                        max_model_len=serving.model_info.max_model_len)])

    @get("/v1/models/{model_id:path}", sync_to_thread=False)
    def model(model_id: str) -> p.ModelCard:
        serving.require_ready(model_id.lstrip("/"))
        assert serving.model_info is not None
        return p.ModelCard(config.model_name, serving.created,
                           max_model_len=serving.model_info.max_model_len)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        return await _run(serving, request, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        return await _run(serving, request, chat=True)

    @post(["/tokenize", "/v1/tokenize"], status_code=200)
    async def tokenize(request: Request) -> p.TokenizeResponse:
        body, _ = parse_body(await request.body(), p.TokenizeRequest)
        tokenizer, _, model_info = serving.require_ready(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            text = apply_chat_template(tokenizer, chat_messages(body.messages),
                                       add_generation_prompt=body.add_generation_prompt)
            tokens = encode(tokenizer, text)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return p.TokenizeResponse(tokens, len(tokens), model_info.max_model_len)

    @post(["/detokenize", "/v1/detokenize"], status_code=200)
    async def detokenize(request: Request) -> p.DetokenizeResponse:
        body, _ = parse_body(await request.body(), p.DetokenizeRequest)
        tokenizer, _, model_info = serving.require_ready(body.model)
        if any(not 0 <= t < model_info.vocab_size for t in body.tokens):
            raise InvalidRequest("tokens", f"token ids must be in [0, {model_info.vocab_size})")
        return p.DetokenizeResponse(tokenizer.decode(body.tokens))

    return Litestar(
        route_handlers=[health, stats, models, model, completions, chat_completions,
                        tokenize, detokenize],
        on_startup=[startup], on_shutdown=[shutdown],
        exception_handlers={Exception: _handle},
    )
