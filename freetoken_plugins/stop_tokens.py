"""The stop_tokens plugin: end a sequence when it draws one of the request's stop token ids.

Request field: ``stop_token_ids``, a list of integers, each a token id in
``[0, vocab_size)``, at most ``MAX_STOP_TOKEN_IDS`` (1,024) of them. Validation rewrites it
in ``request.extra`` as a list of distinct ints in the order given. An empty list is
accepted and stops nothing.

Semantics (vLLM's ``stop_token_ids``): when a sequence draws a token in its list, it
finishes now with ``finish_reason == "stop"`` and ``stop_reason`` the token id; the token
is kept as the last of ``token_ids`` (its text follows ``skip_special_tokens`` like any
other token's). This applies with ``ignore_eos`` too, and before ``max_tokens``: a stop
token drawn as the last allowed token still reports ``"stop"``. The min_tokens plugin holds
these ids back (``-inf``) until ``min_tokens`` tokens were generated.

Not a logits processor: the rule runs on the host token ids the engine already has, in
``freetoken_check_stop``, which the engine calls once per step with only the rows whose
request has ``stop_token_ids``. No device state and no Triton kernel; the cost is one
membership test per such row per step (``token in list``, the lists being short).
"""

from __future__ import annotations

import numbers
from typing import Any

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import ModelInfo, StopView

FIELD = "stop_token_ids"
MAX_STOP_TOKEN_IDS = 1024
"""Most ids one request may list; more is a 400."""
BENCH_PARAMS: dict[str, Any] = {FIELD: [3, 4, 5, 6]}
"""A typical request: four ids that chat never draws on the default model (SmolLM2's
``<repo_name>``, ``<reponame>``, ``<file_sep>``, ``<filename>``), so rows keep running."""


def check_stop_token_ids(value: Any, vocab_size: int) -> list[int]:
    """Return ``value`` as a list of distinct ints, or raise ``InvalidRequest``."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(FIELD, f"stop_token_ids must be a list of token ids, "
                                    f"got {type(value).__name__}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(FIELD, f"stop_token_ids has {len(value)} entries; at most "
                                    f"{MAX_STOP_TOKEN_IDS} are allowed")
    for token in value:
        if not isinstance(token, numbers.Integral) or isinstance(token, bool):
            raise InvalidRequest(FIELD, f"stop_token_ids must hold integers, got {token!r}")
        if not 0 <= token < vocab_size:
            raise InvalidRequest(FIELD, f"stop token id {token} is not in [0, {vocab_size})")
    return list(dict.fromkeys(int(t) for t in value))


@hookimpl
def freetoken_request_fields() -> list[str]:
    return [FIELD]


@hookimpl
def freetoken_validate_request(request: Any, model: ModelInfo) -> None:
    value = request.extra.get(FIELD)
    if value is not None:
        request.extra[FIELD] = check_stop_token_ids(value, model.vocab_size)


@hookimpl
def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]
                         ) -> dict[int, int | str] | None:
    stops: dict[int, int | str] = {}
    for row, (view, token) in enumerate(zip(sequences, token_ids)):
        ids = view.params.extra.get(FIELD)
        if ids and token in ids:
            stops[row] = token
    return stops or None
