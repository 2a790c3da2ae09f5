"""The Litestar app of ``freetoken serve``: routes, start-up and the error handler.

``create_app(config)`` returns an app whose start-up spawns the engine process and whose
shutdown stops it. Until the model is loaded ``/health`` answers 503 and the generation
routes 503; every error is rendered as ``{"error": {"message", "type", "param", "code"}}``
(``InvalidRequest`` and any schema failure → 400, unknown model or route → 404). With
``ServerConfig.api_key`` every route but ``/health`` answers 401 without
``Authorization: Bearer <key>`` (the schema pages included; a CORS preflight passes). The
generation routes live in ``openai_routes.py``; the OpenAPI document at
``/schema/openapi.json`` is completed by ``openapi.py``, and CORS is set up by ``cors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from freetoken_core.affinity import plan_cpus
from freetoken_core.engine.client import EngineClient
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.plugins import PluginManager
from freetoken_core.server import protocol as p
from freetoken_core.server.cors import is_preflight
from freetoken_core.server.metrics import MEDIA_TYPE, ServerMetrics
from freetoken_core.server.openai_routes import run_generation
from freetoken_core.server.openapi import complete_document, openapi_config
from freetoken_core.server.openapi_rules import add_model_rules
from freetoken_core.server.serving import parse_body, render_chat
from freetoken_core.server.state import ServerConfig, Serving, error_of

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("freetoken.server")


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | int | None = None, retry_after_s: int | None = None,
           headers: dict[str, str] | None = None) -> Response:
    """The OpenAI error body; ``headers`` (an exception's own: a 405's ``Allow``) are kept."""
    body = p.ErrorResponse(p.ErrorBody(message, type_, param, code))
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    # JSON whatever the route's own media type (a 401 before the HTML Swagger UI, say).
    return Response(content=body, status_code=status, media_type=MediaType.JSON,
                    headers=headers or None)


def _handle(request: Request, exc: Exception) -> Response:
    if isinstance(exc, FreeTokenError):
        status, body, retry_after_s = error_of(exc)
        return _error(status, body.message, body.type, body.param, body.code, retry_after_s)
    if isinstance(exc, ValidationException):
        return _error(400, str(exc.detail), "invalid_request_error")
    if isinstance(exc, NotFoundException):
        return _error(404, str(exc.detail), "not_found_error", headers=exc.headers)
    if isinstance(exc, HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error",
                      headers=exc.headers)
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


def _version() -> str:
    try:
        return version("freetoken")
    except PackageNotFoundError:
        return "unknown"  # running from a source tree that was never installed


def create_app(config: ServerConfig, client: EngineClient | None = None,
               on_fatal: Callable[[str], None] | None = None) -> Litestar:
    """The app; ``on_fatal(message)`` runs when the engine fails to load or dies (the
    default prints the message and leaves the server up, answering 503)."""

    def fatal(message: str) -> None:
        print(f"freetoken: error: {message}", file=sys.stderr, flush=True)
        if on_fatal is not None:
            on_fatal(message)

    metrics = ServerMetrics()
    client = client or EngineClient(
        config.engine, on_dead=fatal, restart=config.restart,
        on_failure=lambda failed: metrics.record_failure(failed.stage, failed.plugin),
        cpu_plan=plan_cpus() if config.pin_threads else None)
    serving = Serving(config, client, metrics=metrics)
    tasks: set[asyncio.Task[None]] = set()

    async def load() -> None:
        await serving.load(fatal)
        if serving.model_info is not None:  # the document states the model's bounds now
            add_model_rules(app.openapi_schema.components.schemas, serving.model_info)

    async def startup() -> None:
        serving.client.start()
        task = asyncio.create_task(load())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def shutdown() -> None:
        serving.tokenizer_pool.shutdown()
        await asyncio.to_thread(serving.client.shutdown)

    expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None

    def authorize(request: Request) -> Response | None:
        """With an API key, 401 for any route but ``/health`` without the bearer token
        (CORS preflights pass: browsers send them without credentials)."""
        if expected_auth is None or request.url.path == "/health":
            return None
        if config.cors is not None and is_preflight(request.method, request.headers):
            return None
        given = request.headers.get("authorization", "").encode()
        if secrets.compare_digest(given, expected_auth):
            return None
        return _error(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                      "invalid_request_error", code="invalid_api_key")

    @get("/health", sync_to_thread=False)
    def health() -> Response:
        """200 when requests can be served; 503 while the model loads or the engine
        process restarts (with ``Retry-After``)."""
        if not serving.is_ready:
            return _error(503, serving.client.dead_message or "the model is still loading",
                          "service_unavailable", code="engine_unavailable",
                          retry_after_s=serving.client.retry_after_s)
        return Response(content=b"", status_code=200)

    @get("/internal/stats")
    async def stats() -> dict[str, float | list[int]]:  # counts, seconds, histogram
        """The engine's load between two steps and its step times (the engine process's
        ``Stats`` message)."""
        serving.require_ready()
        return msgspec.structs.asdict(await serving.client.stats())

    def model_card() -> p.ModelCard:
        assert serving.model_info is not None
        return p.ModelCard(config.model_name, serving.created,
                           max_model_len=serving.model_info.max_model_len,
                           generation_defaults=dict(serving.generation_defaults.values))

    @get("/v1/models", sync_to_thread=False)
    def models() -> p.ModelList:
        serving.require_ready()
        return p.ModelList([model_card()])

    @get("/v1/models/{model_id:path}", sync_to_thread=False)
    def model(model_id: str) -> p.ModelCard:
        serving.require_ready(model_id.lstrip("/"))
        return model_card()

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        return await run_generation(serving, request, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        return await run_generation(serving, request, chat=True)

    @post(["/tokenize", "/v1/tokenize"], status_code=200)
    async def tokenize(request: Request) -> p.TokenizeResponse:
        body, _, message_extras = parse_body(await request.body(), p.TokenizeRequest)
        tokenizer, plugins, model_info = serving.require_ready(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt", "give exactly one of prompt and messages")
        limits, pool = config.limits, serving.tokenizer_pool
        if body.messages is not None:
            if body.continue_final_message and body.add_generation_prompt:
                raise InvalidRequest("continue_final_message", "continue_final_message and "
                                     "add_generation_prompt cannot both be true")
            limits.check_messages(body.messages)

            def work() -> list[int]:
                text = render_chat(tokenizer, body.messages,
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   chat_template_kwargs=body.chat_template_kwargs,
                                   plugins=plugins, extras=message_extras)
                limits.check_prompt_chars(len(text), "messages")
                return pool.encode(tokenizer, text)
        else:
            limits.check_prompt_chars(len(body.prompt), "prompt")

            def work() -> list[int]:
                return pool.encode(tokenizer, body.prompt, body.add_special_tokens)
        tokens = await pool.run(work)  # off the loop
        return p.TokenizeResponse(tokens, len(tokens), model_info.max_model_len)

    @post(["/detokenize", "/v1/detokenize"], status_code=200)
    async def detokenize(request: Request) -> p.DetokenizeResponse:
        body, _, _ = parse_body(await request.body(), p.DetokenizeRequest)
        tokenizer, _, model_info = serving.require_ready(body.model)

        def work() -> str:
            if any(not 0 <= t < model_info.vocab_size for t in body.tokens):
                raise InvalidRequest("tokens",
                                     f"token ids must be in [0, {model_info.vocab_size})")
            return tokenizer.decode(body.tokens)

        return p.DetokenizeResponse(await serving.tokenizer_pool.run(work))  # off the loop

    @get("/version", sync_to_thread=False)
    def version_() -> p.VersionResponse:
        return p.VersionResponse(_version())

    @get("/metrics")
    async def metrics_() -> Response:
        """Served while the engine is down too (``freetoken_engine_up`` 0, no engine
        gauges), so that restarts can be alerted on."""
        stats = await serving.client.stats() if serving.is_ready else None
        text = metrics.render(stats, serving.client.num_restarts)
        return Response(content=text, media_type=MEDIA_TYPE)

    app = Litestar(
        route_handlers=[health, stats, models, model, completions, chat_completions,
                        tokenize, detokenize, version_, metrics_],
        on_startup=[startup], on_shutdown=[shutdown], before_request=authorize,
        exception_handlers={Exception: _handle},
        request_max_body_size=config.limits.max_body_bytes,
        openapi_config=openapi_config(_version()),
        cors_config=config.cors.litestar_config() if config.cors else None,
    )
    complete_document(app.openapi_schema, config.model_name,
                      PluginManager(config.engine.plugins).plugin_classes(),
                      has_api_key=expected_auth is not None, limits=config.limits)
    return app
