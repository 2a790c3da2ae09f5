"""freetoken_core.testing: the kit passes a correct processor and catches the usual bugs
(state that leaks into a reused slot, a resume that forgets the drawn tokens, rows of other
requests changed, a reference that never acts), and the engine's token history it relies on
stays in step with the sequences."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
import pytest
import torch

from freetoken_core.history import TokenHistory
from freetoken_core.processors import LogitsProcessor, RequestFields, RequestView
from freetoken_core.testing import Harness, check_processor


class BanLast(LogitsProcessor):
    """ban_last_times: lower the logit of the row's last token by this much (a test
    processor that reads the engine's history)."""

    class Fields(RequestFields):
        ban_last_by: Annotated[float, msgspec.Meta(gt=0)] | None = None

    name: ClassVar[str] = "ban_last"
    reads_history = True

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.by = torch.zeros(ctx.max_num_slots, device=ctx.device)

    def add_request(self, slot: int, request: RequestView) -> None:
        self.by[slot] = request.fields.ban_last_by

    def remove_request(self, slot: int) -> None:
        self.by[slot] = 0.0

    def last_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        tokens, length = self.history.window(slots)
        return tokens.gather(1, (length - 1).clamp(min=0).unsqueeze(1))

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        delta = torch.where(self.history.lengths[slots] > 0, -self.by[slots], 0.0)
        logits.scatter_add_(1, self.last_tokens(slots), delta.unsqueeze(1))


class LeaksOnReuse(BanLast):
    name: ClassVar[str] = "leaks_on_reuse"

    def remove_request(self, slot: int) -> None:
        pass  # bug: the next request in this slot inherits ``by``

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        logits.scatter_add_(1, self.last_tokens(slots), -self.by[slots].unsqueeze(1))


class ForgetsOnResume(BanLast):
    """Keeps its own copy of the last token, built from the prompt only."""

    name: ClassVar[str] = "forgets_on_resume"
    reads_history = False

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.last = torch.zeros(ctx.max_num_slots, 1, dtype=torch.long, device=ctx.device)

    def add_request(self, slot: int, request: RequestView) -> None:
        super().add_request(slot, request)
        self.last[slot] = request.prompt_token_ids[-1]  # bug: ignores output_token_ids

    def last_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        return self.last[slots]

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        logits.scatter_add_(1, self.last_tokens(slots), -self.by[slots].unsqueeze(1))

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        self.last[slots] = sampled.unsqueeze(1)


class TouchesOtherRows(BanLast):
    name: ClassVar[str] = "touches_other_rows"

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        super().apply(logits, slots)
        logits[:, 0] -= (self.by[slots] == 0).float()  # bug: rows of other requests change


def ban_last(fields: dict) -> Any:
    def row(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[(prompt + output)[-1]] -= fields["ban_last_by"]
        return logits
    return row


REQUESTS = [{"ban_last_by": 3.0}, {"ban_last_by": 0.5}]


def test_a_correct_processor_passes_and_the_schedule_covers_every_case() -> None:
    report = check_processor(BanLast, REQUESTS, ban_last)
    assert report.rows_checked > 50 and report.rows_unused > 20 and report.mixed_steps > 10
    assert report.slot_reuses and report.preemptions and report.resumes_elsewhere
    assert report.skipped_rows and report.rows_changed == report.rows_checked


@pytest.mark.parametrize(("cls", "message"), [
    (LeaksOnReuse, "does not use the processor, changed"),
    (ForgetsOnResume, "processor and reference differ"),
    (TouchesOtherRows, "does not use the processor, changed"),
])
def test_bugs_are_caught(cls: type[LogitsProcessor], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_processor(cls, REQUESTS, ban_last)


def test_a_reference_that_never_acts_is_refused() -> None:
    def nothing(fields: dict) -> Any:
        return lambda prompt, output, logits: logits

    class Nothing(BanLast):
        name: ClassVar[str] = "nothing"

        def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
            pass

    with pytest.raises(AssertionError, match="never changed a logit"):
        check_processor(Nothing, REQUESTS, nothing)


def test_a_processor_exception_names_the_method() -> None:
    class Raises(BanLast):
        name: ClassVar[str] = "raises"

        def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="failed in apply: RuntimeError: boom"):
        check_processor(Raises, REQUESTS, ban_last)


def test_the_history_follows_the_engine_order() -> None:
    harness = Harness(BanLast, num_slots=3, vocab=16, max_model_len=8)
    history = harness.history
    assert isinstance(history, TokenHistory) and history.width == 0
    assert harness.add(1, {"ban_last_by": 1.0}, [4, 5], [6])
    assert not harness.add(2, None, [7])  # no field: not tracked, length 0
    assert history.lengths.tolist() == [0, 3, 0] and history.num_prompt_tokens[1] == 2
    harness.update([2, 1], [9, 11])  # row 0 is slot 2, which nobody tracks
    assert history.lengths.tolist() == [0, 4, 0] and history.width >= 4
    assert history.token_ids[1, :4].tolist() == [4, 5, 6, 11]
    harness.update([1], [-1])  # a row that drew nothing leaves a valid id behind
    assert history.token_ids[1, 4] == 0
    harness.remove(1)
    assert history.lengths.tolist() == [0, 0, 0] and history.width == 0
    with pytest.raises(ValueError, match="reads the token history"):
        BanLast(harness.processor.ctx.__class__(3, harness.model, torch.device("cpu")))
