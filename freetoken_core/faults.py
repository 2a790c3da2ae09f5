"""Failures that end one request, not the engine or the server.

A plugin is someone else's code: when one of its hooks or processor methods raises
anything but ``InvalidRequest``, the requests that use it fail with a ``RequestError``
naming the plugin and the stage, and everything else goes on. The same type carries the
engine's own per-step failures (a model step that raised, a row whose logits became NaN).
The server answers a ``RequestError`` with ``status`` (500) in the OpenAI error shape:
``{"error": {"message", "type": "server_error", "param": null, "code"}}`` where ``code``
is ``plugin_error`` or ``engine_error``.
"""

from __future__ import annotations

import logging

from freetoken_core.errors import FreeTokenError

log = logging.getLogger("freetoken.plugins")

STAGES = ("validate", "implies", "rewrite_prompt", "chat_template", "decorate_response",
          "prepare_request", "add_request",
          "prepare_step", "apply", "update", "accept_tokens", "remove_request", "check_stop",
          "answer_start", "model", "sampler", "engine")
"""Where a request can fail: a plugin's validation and server-side hooks, processor
methods, stop hooks, the model step, the sampler's finiteness check, and the engine loop
itself."""


class RequestError(FreeTokenError):
    """One request failed at ``stage`` (one of ``STAGES``); ``plugin`` names the plugin
    whose code raised, or is ``None`` for the engine's own failures."""

    status = 500

    def __init__(self, stage: str, message: str, plugin: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.plugin = plugin
        self.message = message

    @property
    def code(self) -> str:
        return "plugin_error" if self.plugin is not None else "engine_error"


def plugin_failure(plugin: str, stage: str, exc: BaseException) -> RequestError:
    """The error that fails the requests using ``plugin`` after its code raised ``exc``;
    logs ``exc`` with its traceback (call it once per failure)."""
    log.error("plugin %s failed in %s", plugin, stage, exc_info=exc)
    return RequestError(stage, f"the plugin {plugin!r} failed in {stage}: "
                               f"{type(exc).__name__}: {exc}", plugin)
