"""CORS for browser clients: off unless ``--allowed-origins`` is given.

The flags are vLLM's (``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``); each list is a JSON list (as vLLM takes it) or comma-separated.
Litestar's CORS middleware adds the ``Access-Control-*`` headers and answers preflight
requests (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``); the API-key
check lets a preflight through, since browsers never send credentials on one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from litestar.config.cors import CORSConfig

from freetoken_core.errors import FreeTokenError

METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class CorsSettingsError(FreeTokenError):
    """A CORS flag has a value that cannot work."""


def parse_list(text: str) -> tuple[str, ...]:
    """``'["a", "b"]'`` or ``"a,b"`` → ``("a", "b")``; blank items are dropped."""
    stripped = text.strip()
    if stripped.startswith(("[", "{", '"')):  # JSON, which must be a list
        try:
            items: Any = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise CorsSettingsError(f"{text!r} is not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise CorsSettingsError(f"{text!r} must be a JSON list of strings")
    else:
        items = stripped.split(",")
    return tuple(i.strip() for i in items if i.strip())


@dataclass(frozen=True)
class CorsSettings:
    """Which browser origins may call the server; ``*`` in a list allows any. Raises
    ``CorsSettingsError`` for an empty origin list, an unknown method, or credentials with
    the ``*`` origin (browsers refuse ``Access-Control-Allow-Origin: *`` with credentials)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if not self.allowed_origins:
            raise CorsSettingsError("--allowed-origins needs at least one origin")
        unknown = [m for m in self.allowed_methods if m != "*" and m.upper() not in METHODS]
        if unknown:
            raise CorsSettingsError(f"--allowed-methods: unknown method(s) {unknown}; "
                                    f"known: {sorted(METHODS)} or *")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise CorsSettingsError("--allow-credentials needs explicit --allowed-origins: "
                                    "browsers refuse credentials when any origin is allowed")

    def litestar_config(self) -> CORSConfig:
        return CORSConfig(
            allow_origins=list(self.allowed_origins),
            allow_methods=[m if m == "*" else m.upper() for m in self.allowed_methods],  # type: ignore[misc]
            allow_headers=list(self.allowed_headers),
            allow_credentials=self.allow_credentials)


def is_preflight(method: str, headers: Any) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``."""
    return (method == "OPTIONS" and "origin" in headers
            and "access-control-request-method" in headers)
