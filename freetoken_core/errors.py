"""Exceptions shared by the engine, the offline API and (later) the server."""

from __future__ import annotations

import re

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's ``code`` for a prompt, or a prompt plus ``max_tokens``, that does not fit."""


class FreeTokenError(Exception):
    """Base class of every error FreeToken raises on purpose."""


class InvalidRequest(FreeTokenError, ValueError):
    """A request field is invalid; the server turns it into HTTP 400 naming ``param``.

    ``code`` is OpenAI's machine-readable ``error.code`` (e.g. ``CONTEXT_LENGTH_EXCEEDED``),
    ``None`` for most validation failures, as OpenAI answers them.
    """

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


class ModelLoadError(FreeTokenError):
    """A model could not be found, read or understood. The message says what to do."""


_PATH = re.compile(r"(?:at|in) `\$\.?([^`]*)`")
_FIELD = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")


def param_of(error: Exception) -> str | None:
    """The field a msgspec validation error is about: ``max_tokens``, ``messages[0].role``."""
    text = str(error)
    path = _PATH.search(text)
    field = _FIELD.search(text)
    where = path.group(1).replace("[...]", "") if path else ""
    parts = [p for p in (where, field.group(1) if field else "") if p]
    return ".".join(parts) or None


class CommunicationError(FreeTokenError):
    """A collective of a tensor-parallel group cannot complete: a peer rank died, closed, or
    did not arrive in time (``distributed/comm.py``). The message names the rank that raised,
    the peer and the reason. The group is broken afterwards: close the communicator and end
    the process."""
