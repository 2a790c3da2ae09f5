"""A plugin that makes the model write a given answer: a test double for end-to-end tests of
what the server does with a known sequence of tokens (special tokens included, which no
grammar allows).

Tests install it for one server process only (``tests/test_harmony.py`` puts this
directory and a generated ``.dist-info`` naming ``freetoken_script:Script`` on that
process's ``PYTHONPATH``). Its field ``script_token_ids`` lists the tokens every choice of
the request draws, in order, whatever the model and the other sampling fields say; after
the last one the model draws freely (end the script with an EOS id to end the choice).
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)


class Script(LogitsProcessor):
    """script_token_ids: the tokens each choice draws, in order."""

    class Fields(RequestFields):
        script_token_ids: list[int] | None = None

    stage = Stage.MASK

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self.scripts: dict[int, list[int]] = {}
        self.positions: dict[int, int] = {}

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        if not all(0 <= t < model.vocab_size for t in fields.script_token_ids or []):
            raise InvalidRequest("script_token_ids", "token ids must be in the vocabulary")
        return fields

    def add_request(self, slot: int, request: RequestView) -> None:
        self.scripts[slot] = list(request.fields.script_token_ids)
        self.positions[slot] = len(request.output_token_ids)

    def remove_request(self, slot: int) -> None:
        self.scripts.pop(slot, None)
        self.positions.pop(slot, None)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        for row, slot in enumerate(slots.tolist()):
            script = self.scripts.get(slot)
            if script is not None and self.positions[slot] < len(script):
                logits[row] = float("-inf")
                logits[row, script[self.positions[slot]]] = 0.0

    def accept_tokens(self, slots: list[int], token_ids: list[int]) -> None:
        for slot in slots:
            if slot in self.positions:
                self.positions[slot] += 1
