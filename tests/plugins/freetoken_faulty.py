"""A plugin that fails on purpose: a test double for the fault-isolation tests.

Tests install it for one server process only (``tests/test_fault_isolation.py`` puts this
directory and a generated ``.dist-info`` naming ``freetoken_faulty:Faulty`` on that
process's ``PYTHONPATH``). Its fields:

* ``fail_at``: the stage whose code raises for this request: ``validate``, ``implies``,
  ``chat_template`` (chat requests), ``add_request``, ``apply``, ``update`` or
  ``check_stop``; or ``nan``, which turns the request's logits into NaN (the engine must
  fail it instead of emitting a token).
* ``slow_step_s``: ``apply`` sleeps this long every step while the request runs (to hold a
  request in the engine while a test disconnects from it).

A request without these fields never reaches the plugin (``uses`` is false), so only the
requests that ask for a failure can be failed by it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
import torch

from freetoken_core import hookimpl
from freetoken_core.processors import (
    ChatView,
    Implied,
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
    StopView,
)

Mode = Literal["validate", "implies", "chat_template", "add_request", "apply", "update",
               "check_stop", "nan"]


class Faulty(LogitsProcessor):
    """fail_at / slow_step_s: raise in the stage asked for, or slow every step down."""

    class Fields(RequestFields):
        fail_at: Mode | None = None
        slow_step_s: Annotated[float, msgspec.Meta(ge=0)] | None = None

    stage = Stage.PRE_TEMPERATURE

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self.modes: dict[int, tuple[Mode | None, float]] = {}

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        if fields.fail_at == "validate":
            raise RuntimeError("faulty validate")
        return fields

    @classmethod
    def implies(cls, fields: Fields, params: Any) -> Implied | None:
        if fields.fail_at == "implies":
            raise RuntimeError("faulty implies")
        return None

    @staticmethod
    @hookimpl
    def freetoken_chat_template(chat: ChatView) -> None:
        fields = None if chat.params is None else chat.params.fields.get("faulty")
        if fields is not None and fields.fail_at == "chat_template":
            raise RuntimeError("faulty chat_template")

    def add_request(self, slot: int, request: RequestView) -> None:
        fields = request.fields
        if fields.fail_at == "add_request":
            raise RuntimeError("faulty add_request")
        self.modes[slot] = (fields.fail_at, fields.slow_step_s or 0.0)

    def remove_request(self, slot: int) -> None:
        self.modes.pop(slot, None)

    def _has(self, mode: Mode) -> bool:
        return any(m == mode for m, _ in self.modes.values())

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        time.sleep(max((s for _, s in self.modes.values()), default=0.0))
        if self._has("apply"):
            raise RuntimeError("faulty apply")
        for row, slot in enumerate(slots.tolist()):
            if self.modes.get(slot, (None, 0.0))[0] == "nan":
                logits[row] = float("nan")

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        if self._has("update"):
            raise RuntimeError("faulty update")

    @staticmethod
    @hookimpl
    def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]) -> None:
        if any(view.fields.fail_at == "check_stop" for view in sequences):
            raise RuntimeError("faulty check_stop")
