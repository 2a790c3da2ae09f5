"""What the server may send the engine process: values its msgpack encoding can carry.

A request reaches the engine as an ``AddRequest`` encoded with msgpack (``process.py``),
which carries integers in ``[-2**63, 2**64)`` only and nests only as deep as msgspec
recurses. JSON has no such bounds: a JSON schema holding ``1e30`` written as an integer
(``{"maximum": 100000000000000000000}``) decodes fine and then fails the encoding with an
``OverflowError``. The server calls ``check_carryable`` on a validated request before it
hands it to the engine client (after the plugins, which may normalise a value: a logit
bias of 1e400 is clamped to 100): it encodes the request once, and when that fails,
``uncarryable`` finds the value and the 400 names its path in the fields the client sent
(``field[0].schema.properties...``) before those a plugin implied from them. Nothing a
request carries can then make the send fail.
"""

from __future__ import annotations

from typing import Any

import msgspec

from freetoken_core.engine.process import add_request
from freetoken_core.errors import InvalidRequest
from freetoken_core.sampling_params import SamplingParams

__all__ = ["INT_MAX", "INT_MIN", "MAX_DEPTH", "check_carryable", "uncarryable"]

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
"""msgpack's integers: int64 below zero, uint64 above."""
MAX_DEPTH = 200
"""The deepest nesting of lists and objects a request field may hold (msgspec's encoder
recurses; the message wraps a field in a few levels of its own)."""

_ENCODER = msgspec.msgpack.Encoder()


def uncarryable(value: Any, path: str) -> tuple[str, str] | None:
    """The first place in ``value`` (JSON-decoded: dicts, lists, scalars) that msgpack cannot
    carry, as ``(path, reason)``; ``path`` extends ``path`` in the error ``param`` style
    (``field[0].schema.properties.n.maximum``). ``None`` when it can all be
    carried. Iterative: any depth is walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, bool) or item is None or isinstance(item, (str, float)):
            continue
        if isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                return where, "holds an integer outside [-2**63, 2**64)"
            continue
        if depth >= MAX_DEPTH:
            return where, f"is nested more than {MAX_DEPTH} levels deep"
        if isinstance(item, dict):
            children = [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(v, f"{where}[{i}]") for i, v in enumerate(item)]
        else:
            continue  # a Struct or another typed value: check_carryable encodes it
        stack.extend((child, child_path, depth + 1) for child, child_path in reversed(children))
    return None


def check_carryable(params: SamplingParams) -> None:
    """Raise ``InvalidRequest`` naming the field when the ``AddRequest`` of a request with
    ``params`` (validated: ``params.fields`` set) cannot be encoded; the server calls it
    before it hands the request to the engine client, whose send then cannot fail on the
    request's values. ``params.extra`` (the plugin fields as sent) orders the search."""
    try:
        _ENCODER.encode(add_request("", [], params))
    except (OverflowError, RecursionError, TypeError, ValueError) as exc:
        raise InvalidRequest(*_locate(params, exc)) from None


def _locate(params: SamplingParams, exc: Exception) -> tuple[str | None, str]:
    """``(param, message)`` for the field of ``params`` that failed the encoding."""
    values: dict[str, Any] = dict(params.core_fields())
    for fields in params.fields.values():
        values.update(msgspec.structs.asdict(fields))
    sent = set(params.core_fields()) | set(params.extra)
    for name, value in sorted(values.items(), key=lambda item: item[0] not in sent):
        try:
            _ENCODER.encode(value)
        except (OverflowError, RecursionError, TypeError, ValueError):
            try:
                found = uncarryable(msgspec.to_builtins(value), name)
            except (OverflowError, RecursionError, TypeError, ValueError):
                found = None
            where, reason = found or (name, f"cannot be sent to the engine ({exc})")
            return where, f"{where} {reason}"
    return None, f"the request cannot be sent to the engine ({type(exc).__name__}: {exc})"
