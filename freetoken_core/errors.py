"""Exceptions shared by the engine, the offline API and (later) the server."""

from __future__ import annotations


class FreeTokenError(Exception):
    """Base class of every error FreeToken raises on purpose."""


class InvalidRequest(FreeTokenError, ValueError):
    """A request field is invalid; the server turns it into HTTP 400 naming ``param``."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class ModelLoadError(FreeTokenError):
    """A model could not be found, read or understood. The message says what to do."""
