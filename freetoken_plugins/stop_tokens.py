"""The stop_tokens plugin: end a sequence when it draws one of the request's stop token ids.

Request field: ``stop_token_ids``, a list of integers, each a token id in
``[0, vocab_size)``, at most ``MAX_STOP_TOKEN_IDS`` (1,024) of them. Validation keeps
them as a list of distinct ints in the order given. An empty list is
accepted and stops nothing.

Semantics (vLLM's ``stop_token_ids``): when a sequence draws a token in its list, it
finishes now with ``finish_reason == "stop"`` and ``stop_reason`` the token id; the token
is kept as the last of ``token_ids`` (its text follows ``skip_special_tokens`` like any
other token's). This applies with ``ignore_eos`` too, and before ``max_tokens``: a stop
token drawn as the last allowed token still reports ``"stop"``. The min_tokens plugin holds
these ids back (``-inf``) until ``min_tokens`` tokens were generated.

Not a logits processor (a ``Plugin`` with a hook): the rule runs on the host token ids
the engine already has, in ``freetoken_check_stop``, which the engine calls once per step with only the rows whose
request has ``stop_token_ids``. No device state and no Triton kernel; the cost is one
membership test per such row per step (``token in list``, the lists being short).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import ModelInfo, Plugin, RequestFields, StopView

FIELD = "stop_token_ids"
MAX_STOP_TOKEN_IDS = 1024
"""Most ids one request may list; more is a 400."""
BENCH_PARAMS: dict[str, Any] = {FIELD: [3, 4, 5, 6]}
"""A typical request: four ids that chat never draws on the default model (SmolLM2's
``<repo_name>``, ``<reponame>``, ``<file_sep>``, ``<filename>``), so rows keep running."""

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class StopTokens(Plugin):
    """stop_token_ids: end a sequence when it draws one of the request's stop token ids."""

    class Fields(RequestFields):
        stop_token_ids: Annotated[list[TokenId], msgspec.Meta(
            max_length=MAX_STOP_TOKEN_IDS)] | None = None

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        ids = fields.stop_token_ids or []
        for token in ids:
            if token >= model.vocab_size:
                raise InvalidRequest(FIELD, f"stop token id {token} is not in "
                                            f"[0, {model.vocab_size})")
        return cls.Fields(stop_token_ids=list(dict.fromkeys(ids)))

    @staticmethod
    @hookimpl
    def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]
                             ) -> dict[int, int | str] | None:
        stops: dict[int, int | str] = {}
        for row, (view, token) in enumerate(zip(sequences, token_ids)):
            if token in view.fields.stop_token_ids:
                stops[row] = token
        return stops or None
