"""What the routes of ``freetoken serve`` share: its config, the engine client, the
tokenizer and plugins once loaded, the metrics, and the error type with an HTTP status."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken_core.config import EngineConfig
from freetoken_core.engine.client import EngineClient, EngineDeadError, RestartPolicy
from freetoken_core.engine.generation_defaults import GenerationDefaults
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.faults import RequestError
from freetoken_core.models.resolve import DEFAULT_MODEL_NAME, resolved_without_converting
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.server.cors import CorsSettings
from freetoken_core.server.limits import RequestLimits, TokenizerPool
from freetoken_core.server.metrics import ServerMetrics
from freetoken_core.server.protocol import ErrorBody, ResponseTypes
from freetoken_core.tokenizer import load_tokenizer


@dataclass(frozen=True)
class ServerConfig:
    """What ``freetoken serve`` was asked to serve; ``served_model_name`` is the ``model``
    clients name (default: the ``--model`` argument, or the embedded model's name)."""

    engine: EngineConfig
    served_model_name: str | None = None
    api_key: str | None = None
    """When set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Per-request bounds (stop strings, prompts, sequences, prompt text, body size)."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """When to start a new engine process after one died (``--engine-restart-*``)."""
    cors: CorsSettings | None = None
    """Browser origins allowed (``--allowed-origins``); ``None``: no CORS headers at all."""
    pin_threads: bool = False
    """The engine's main thread on a CPU of its own, everything else on the other CPUs
    (freetoken_core.affinity). ``freetoken serve`` turns it on (``--no-pin-threads``: off);
    off here so that an app built in another program leaves that program's CPUs alone."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME


class ApiError(FreeTokenError):
    """An error with its HTTP status and OpenAI ``type`` / ``code``."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)
        self.retry_after_s = retry_after_s
        """Sent as ``Retry-After`` (a 503 while the engine loads or restarts)."""


def error_of(exc: FreeTokenError) -> tuple[int, ErrorBody, int | None]:
    """The HTTP status, OpenAI error body and ``Retry-After`` seconds (or ``None``) of an
    error FreeToken raised on purpose; a streamed response sends the body as its one error
    event instead."""
    if isinstance(exc, InvalidRequest):
        return 400, ErrorBody(exc.message, "invalid_request_error", exc.param, exc.code), None
    if isinstance(exc, ApiError):
        return exc.status, ErrorBody(exc.message, exc.type, exc.param, exc.code), \
            exc.retry_after_s
    if isinstance(exc, EngineDeadError):
        return 503, ErrorBody(str(exc), "service_unavailable", None, "engine_unavailable"), 1
    if isinstance(exc, RequestError):  # a plugin or the engine failed this request
        return exc.status, ErrorBody(str(exc), "server_error", None, exc.code), None
    return 500, ErrorBody(str(exc), "server_error"), None


@dataclass
class Serving:
    """What the routes share, filled in once the engine reports ``Ready``."""

    config: ServerConfig
    client: EngineClient
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None
    plugins: PluginManager | None = None
    response_types: ResponseTypes = field(default_factory=ResponseTypes)
    """Message, delta and usage Structs with the enabled plugins' response fields."""
    model_info: ModelInfo | None = None
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    """What requests that leave a field unset get (the engine process read and checked
    them); applied here, before validation."""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    tokenizer_pool: TokenizerPool = field(init=False)
    """Where the routes tokenize and render templates: worker threads, off the loop."""

    def __post_init__(self) -> None:
        self.tokenizer_pool = TokenizerPool(self.config.limits.num_tokenizer_threads,
                                            self.config.limits.idle_priority_chars)

    @property
    def is_ready(self) -> bool:
        return self.model_info is not None and self.client.ready

    def require_ready(self, model: str | None = None) -> tuple[Any, PluginManager, ModelInfo]:
        if not self.is_ready:
            raise ApiError(503, self.client.dead_message or "the model is still loading",
                           "service_unavailable", "engine_unavailable",
                           retry_after_s=self.client.retry_after_s)
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "invalid_request_error",
                           "model_not_found", "model")
        assert self.plugins is not None and self.model_info is not None
        return self.tokenizer, self.plugins, self.model_info

    def _early_tokenizer(self) -> tuple[Path, Any] | None:
        """(model directory, its tokenizer) when the directory is known before the engine is
        ready; ``None`` otherwise, or on any error (the engine's load then reports it)."""
        model_dir = resolved_without_converting(self.config.engine.model)
        if model_dir is None:
            return None
        try:
            return model_dir, load_tokenizer(model_dir, self.config.engine.chat_template_text())
        except Exception:  # noqa: BLE001 - the load after the engine's reports any error
            return None

    async def load(self, on_fatal: Callable[[str], None]) -> None:
        """Wait for the engine, then load the tokenizer and the plugins for validation.

        Where the model's directory is known without converting anything (a directory, or a
        GGUF converted on an earlier start), its tokenizer loads while the engine starts
        (~1.4 s here, most of it importing transformers), instead of after it."""
        early = asyncio.create_task(asyncio.to_thread(self._early_tokenizer))
        try:
            info = await self.client.wait_ready()
        except EngineDeadError:
            return  # already reported through the client's on_dead
        try:
            preloaded = await early
            if preloaded is not None and preloaded[0] == Path(info.model_dir):
                self.tokenizer = preloaded[1]
            else:
                self.tokenizer = await asyncio.to_thread(
                    load_tokenizer, Path(info.model_dir), self.config.engine.chat_template_text())
            self.tokenizer_pool.attach(self.tokenizer)
            plugins = PluginManager(self.config.engine.plugins,
                                    self.config.engine.plugin_options)
            plugins.enabled  # noqa: B018 (loads the plugins now, not on the first request)
            plugins.on_failure = lambda error: self.metrics.record_failure(error.stage,
                                                                           error.plugin)
            self.response_types = ResponseTypes.build(plugins.plugin_classes())
            self.plugins = plugins
            self.generation_defaults = info.generation_defaults
            info.generation_defaults.log(logging.getLogger("freetoken.server"))
            self.model_info = ModelInfo(info.vocab_size, info.eos_token_ids, info.max_model_len)
        except FreeTokenError as exc:
            on_fatal(str(exc))
