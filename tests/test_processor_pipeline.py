"""The processor contract as the engine drives it: slots, order, skipping, preemption."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest
import torch

from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.engine.scheduler import Scheduler
from freetoken_core.engine.sequence import Sequence
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    Stage,
    check_plugin_class,
)
from freetoken_core.sampling_params import SamplingParams

MODEL = ModelInfo(vocab_size=8, eos_token_ids=frozenset({2}), max_model_len=64)


def ctx(max_num_slots: int) -> ProcessorContext:
    return ProcessorContext(max_num_slots, MODEL, torch.device("cpu"))


class Recorder(LogitsProcessor):
    """Test double: adds its per-slot value to token 0 and records every call."""

    name = "recorder"
    stage = Stage.PRE_TEMPERATURE
    calls: ClassVar[list] = []

    class Fields(RequestFields):
        bump: float | None = None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.value = torch.zeros(ctx.max_num_slots)
        self.seen = torch.zeros(ctx.max_num_slots, dtype=torch.long)

    def add_request(self, slot, request):
        self.calls.append(("add", slot, list(request.output_token_ids)))
        self.value[slot] = request.fields.bump
        self.seen[slot] = len(request.output_token_ids)

    def remove_request(self, slot):
        self.calls.append(("remove", slot))
        self.value[slot] = 0.0

    def update(self, slots, sampled):
        self.seen[slots] += 1

    def apply(self, logits, slots):
        self.calls.append(("apply", slots.tolist()))
        logits[:, 0] += self.value[slots]


class Doubler(Recorder):
    name = "doubler"
    stage = Stage.POST_TEMPERATURE
    argmax_invariant = True

    class Fields(RequestFields):
        double: bool | None = None

    def add_request(self, slot, request):
        self.calls.append(("add-doubler", slot))

    def remove_request(self, slot):
        pass

    def apply(self, logits, slots):
        self.calls.append(("apply-doubler", slots.tolist()))


@pytest.fixture(autouse=True)
def clear_calls():
    Recorder.calls.clear()


def validated(params: SamplingParams) -> SamplingParams:
    """``params.fields`` as ``PluginManager.validate`` fills them (the test doubles are not
    installed through entry points)."""
    for cls in (Recorder, Doubler):
        sent = {f: params.extra[f] for f in cls.Fields.__struct_fields__ if f in params.extra}
        fields = msgspec.convert(sent, cls.Fields)
        if cls.uses(fields):
            params.fields[cls.name] = cls.validate(fields, MODEL, params)
    return params


def seq(seq_id: int, slot: int | None, **extra) -> Sequence:
    params = validated(SamplingParams(temperature=0, **extra))
    s = Sequence(seq_id, str(seq_id), [5, 6, 7], 3, params, seq_id, seq_id, 8)
    s.slot = slot
    return s


def test_only_users_are_added_and_unused_processors_do_not_run() -> None:
    pipe = ProcessorPipeline([Recorder, Doubler], ctx(4))
    assert [p.name for p in pipe.processors] == ["recorder", "doubler"]
    plain = seq(0, 0)
    pipe.add_request(0, plain)
    assert Recorder.calls == [] and not pipe.active()
    sampler = Sampler(pipe)
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0
    out = sampler(logits, SamplingBatch.from_seqs([plain], torch.device("cpu")))
    assert out.token_ids == [3] and Recorder.calls == []


def test_apply_changes_only_using_rows_and_greedy_skips_argmax_invariant() -> None:
    pipe = ProcessorPipeline([Recorder, Doubler], ctx(4))
    a, b = seq(0, 2, bump=5.0, double=True), seq(1, 0)
    pipe.add_request(2, a)
    pipe.add_request(0, b)
    logits = torch.zeros(2, 8)
    logits[:, 3] = 1.0
    out = Sampler(pipe)(logits, SamplingBatch.from_seqs([a, b], torch.device("cpu")))
    assert out.token_ids == [0, 3]  # only row 0 (slot 2) got the bump
    assert ("apply", [2, 0]) in Recorder.calls
    assert not any(c[0] == "apply-doubler" for c in Recorder.calls)  # all greedy
    assert pipe.processors[0].seen[2].item() == 1  # update ran


def test_remove_resets_and_slot_can_be_reused() -> None:
    pipe = ProcessorPipeline([Recorder], ctx(2))
    first = seq(0, 1, bump=3.0)
    first.token_ids, first.num_prompt_tokens = [1], 1
    pipe.add_request(1, first)
    pipe.remove_request(1)
    assert not pipe.active() and pipe.processors[0].value[1] == 0
    again = seq(1, 1, bump=4.0)
    again.token_ids, again.num_prompt_tokens = [1, 9], 1  # a preempted one, with its output
    pipe.add_request(1, again)
    assert pipe.processors[0].value[1] == 4.0 and pipe.processors[0].seen[1] == 1


def test_scheduler_gives_slots_and_resumes_preempted_with_their_outputs() -> None:
    pipe = ProcessorPipeline([Recorder], ctx(2))
    admitted, released = [], []

    def on_admit(s: Sequence) -> None:
        admitted.append((s.seq_id, s.slot))
        pipe.add_request(s.slot, s)

    def on_release(s: Sequence) -> None:
        released.append((s.seq_id, s.slot))
        pipe.remove_request(s.slot)

    sched = Scheduler(BlockManager(4, 4), 2, 100, on_admit=on_admit, on_release=on_release)
    a, b = seq(0, None, bump=1.0), seq(1, None, bump=2.0)
    a.token_ids, b.token_ids = [1] * 7, [2] * 7
    a.num_prompt_tokens = b.num_prompt_tokens = 7
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        batch = sched.schedule()
        sched.advance(batch)
        for s in batch.seqs:
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(3)
    assert sorted(admitted) == [(0, 1), (1, 0)] or sorted(admitted) == [(0, 0), (1, 1)]
    assert released and released[0][0] == 1  # b was preempted, its slot released
    assert b.slot is None
    sched.finish(a, "stop")
    batch = sched.schedule()
    # b comes back with the token it had drawn before preemption.
    assert b.output_token_ids and ("add", b.slot, b.output_token_ids) in Recorder.calls
    assert len(sched._free_slots) == 1


def test_registration_is_checked() -> None:
    class NoName(LogitsProcessor):
        pass

    with pytest.raises(ValueError):
        check_plugin_class(NoName)
    with pytest.raises(TypeError):
        check_plugin_class(int)
    with pytest.raises(ValueError):
        ProcessorPipeline([Recorder, Recorder], ctx(2))
