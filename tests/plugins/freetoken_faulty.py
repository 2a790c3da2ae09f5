"""A plugin that fails on purpose: a test double for the fault-isolation tests.

Tests install it for one server process only (``tests/test_fault_isolation.py`` puts this
directory and a generated ``.dist-info`` on that process's ``PYTHONPATH``). Its fields:

* ``fail_at``: the stage whose code raises for this request: ``validate_request``,
  ``add_request``, ``apply``, ``update`` or ``check_stop``; or ``nan``, which turns the
  request's logits into NaN (the engine must fail it instead of emitting a token).
* ``slow_step_s``: ``apply`` sleeps this long every step while the request runs (to hold a
  request in the engine while a test disconnects from it).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from freetoken_core import hookimpl
from freetoken_core.processors import LogitsProcessor, ModelInfo, Stage, StopView

FIELDS = ("fail_at", "slow_step_s")


class FaultyProcessor(LogitsProcessor):
    name = "faulty"
    stage = Stage.PRE_TEMPERATURE
    fields = FIELDS

    def __init__(self, max_num_slots: int, model: ModelInfo, device: torch.device) -> None:
        super().__init__(max_num_slots, model, device)
        self.modes: dict[int, tuple[str | None, float]] = {}

    def add_request(self, slot: int, params: Any, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> None:
        mode = params.extra.get("fail_at")
        if mode == "add_request":
            raise RuntimeError("faulty add_request")
        self.modes[slot] = (mode, float(params.extra.get("slow_step_s") or 0.0))

    def remove_request(self, slot: int) -> None:
        self.modes.pop(slot, None)

    def _has(self, mode: str) -> bool:
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


@hookimpl
def freetoken_request_fields() -> list[str]:
    return list(FIELDS)


@hookimpl
def freetoken_register_processors(register: Any) -> None:
    register(FaultyProcessor)


@hookimpl
def freetoken_validate_request(request: Any, model: ModelInfo) -> None:
    if request.extra.get("fail_at") == "validate_request":
        raise RuntimeError("faulty validate_request")


@hookimpl
def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]) -> None:
    if any(view.params.extra.get("fail_at") == "check_stop" for view in sequences):
        raise RuntimeError("faulty check_stop")
