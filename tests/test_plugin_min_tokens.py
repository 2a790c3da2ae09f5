"""The min_tokens plugin: validation, torch and Triton paths against references, engine runs."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import msgspec
import pytest
import torch
from kernel_checks import assert_kernel_is_lazy_and_compiles
from transformers import MinNewTokensLengthLogitsProcessor

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sequence import Sequence
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, ProcessorContext, RequestView, Stage
from freetoken_plugins import min_tokens as plugin
from freetoken_plugins.logit_bias import LogitBias
from freetoken_plugins.min_tokens import MinTokens

VOCAB = 642
EOS = 2
MODEL = ModelInfo(VOCAB, frozenset({EOS}), 2048)
NEG_INF = float("-inf")

BAD_VALUES = [True, False, -1, 1.5, 2.0, "3", [3], {"n": 3}, float("nan"), float("inf"), 1j]


class Slot:
    """What the reference needs to know about one slot."""

    def __init__(self, rng: random.Random, vocab: int, max_stop_ids: int = 6) -> None:
        self.min_tokens = rng.randint(1, 12)
        self.num_output = rng.randint(0, 14)
        self.ignore_eos = rng.random() < 0.25
        self.stop_ids = rng.sample(range(vocab), rng.randint(0, max_stop_ids))
        self.params = SamplingParams(min_tokens=self.min_tokens, max_tokens=64,
                                     ignore_eos=self.ignore_eos,
                                     stop_token_ids=self.stop_ids or None)

    @property
    def mask_ids(self) -> set[int]:
        return set(self.stop_ids) | (set() if self.ignore_eos else {EOS})


@functools.cache
def manager() -> PluginManager:
    """min_tokens with stop_tokens, whose ``stop_token_ids`` it holds back too."""
    return PluginManager("min_tokens,stop_tokens")


def validated(params: SamplingParams, model: ModelInfo = MODEL) -> SamplingParams:
    """``params`` after the server's validation (``params.fields`` filled)."""
    manager().validate(params, model)
    return params


def check(params: SamplingParams, model: ModelInfo = MODEL) -> MinTokens.Fields:
    """``MinTokens.validate`` of ``params``'s typed field, given the request's core
    parameters (``max_tokens``, ``ignore_eos``, ``stop_token_ids`` as sent)."""
    fields = msgspec.convert({"min_tokens": params.extra["min_tokens"]}, MinTokens.Fields)
    return MinTokens.validate(fields, model, params)


def view(params: SamplingParams, prompt: list[int], output: list[int],
         model: ModelInfo = MODEL) -> RequestView:
    """The sequence ``add_request`` receives, ``params`` validated first."""
    validated(params, model)
    return RequestView("r", 0, params.fields["min_tokens"], params, prompt, output)


def make(num_slots: int, model: ModelInfo = MODEL, device: torch.device | str = "cpu"
         ) -> MinTokens:
    return MinTokens(ProcessorContext(num_slots, model, torch.device(device)))


def processor(states: dict[int, Slot], num_slots: int = 8, model: ModelInfo = MODEL,
              device: torch.device | str = "cpu") -> MinTokens:
    proc = make(num_slots, model, device)
    for slot, state in states.items():
        proc.add_request(slot, view(state.params, [1, 2, 3], [7] * state.num_output, model))
    return proc


def reference(logits: torch.Tensor, slots: list[int], states: dict[int, Slot]) -> torch.Tensor:
    """Row by row: while the slot generated fewer than min_tokens, its stop ids are -inf."""
    out = logits.clone()
    for row, slot in enumerate(slots):
        state = states.get(slot)
        if state is not None and state.num_output < state.min_tokens:
            for token in state.mask_ids:
                out[row, token] = NEG_INF
    return out


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_validation_rejects_bad_value(value) -> None:
    with pytest.raises(msgspec.ValidationError, match="min_tokens"):  # the published type
        msgspec.convert({"min_tokens": value}, MinTokens.Fields)
    with pytest.raises(InvalidRequest) as info:
        validated(SamplingParams(min_tokens=value))
    assert info.value.param == "min_tokens"
    assert "min_tokens" in info.value.message


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        check(SamplingParams(min_tokens=11, max_tokens=10))
    assert info.value.param == "min_tokens" and "max_tokens" in info.value.message
    for ok, expected in ((SamplingParams(min_tokens=10, max_tokens=10), 10),
                         (SamplingParams(min_tokens=10**30, max_tokens=None), 2048),
                         (SamplingParams(min_tokens=3), 3), (SamplingParams(min_tokens=0), 0)):
        value = check(ok).min_tokens
        assert type(value) is int and value == expected


def test_min_tokens_beyond_the_context_is_stored_as_the_context() -> None:
    """Same effect (a sequence never generates more), and it fits int64 on the wire."""
    for value in (MODEL.max_model_len + 1, 2**63, 10**400):
        params = validated(SamplingParams(min_tokens=value, max_tokens=None))
        assert params.fields["min_tokens"].min_tokens == MODEL.max_model_len
        wire = msgspec.msgpack.encode(params.fields["min_tokens"])
        assert msgspec.msgpack.decode(wire, type=MinTokens.Fields).min_tokens == 2048


def test_min_tokens_holding_back_the_whole_vocabulary_is_refused() -> None:
    """Every logit -inf would leave nothing to draw."""
    small = ModelInfo(8, frozenset({EOS}), 64)
    others = [t for t in range(8) if t != EOS]
    with pytest.raises(InvalidRequest) as info:
        check(SamplingParams(min_tokens=1, stop_token_ids=others), small)
    assert info.value.param == "min_tokens" and "vocabulary" in info.value.message
    for ok in (SamplingParams(min_tokens=1, stop_token_ids=others[1:]),  # one token left
               SamplingParams(min_tokens=1, stop_token_ids=others, ignore_eos=True),
               SamplingParams(min_tokens=0, stop_token_ids=others)):
        check(ok, small)


def test_generate_rejects_every_bad_value(tiny_llm: LLM) -> None:
    for value in BAD_VALUES:
        with pytest.raises(InvalidRequest) as info:
            tiny_llm.generate("hello", SamplingParams(min_tokens=value, max_tokens=4))
        assert info.value.param == "min_tokens", value
    assert not tiny_llm.engine.has_unfinished_requests


@pytest.mark.parametrize("request_", [
    {"min_tokens": 5, "max_tokens": 4},
    {"min_tokens": 1, "max_tokens": 4, "stop_token_ids": [t for t in range(8) if t != EOS]},
], ids=["above_max_tokens", "whole_vocabulary"])
def test_validation_refuses_what_the_core_parameters_forbid(request_: dict) -> None:
    with pytest.raises(InvalidRequest) as info:
        validated(SamplingParams(**request_), ModelInfo(8, frozenset({EOS}), 64))
    assert info.value.param == "min_tokens"


def test_declared_traits() -> None:
    assert MinTokens.stage is Stage.HOLD and not MinTokens.argmax_invariant
    assert Stage.BIAS < MinTokens.stage  # a +100 bias on EOS cannot beat the mask
    assert manager().processor_classes() == [MinTokens] and MinTokens.name == "min_tokens"
    assert manager().field_owners() == {"min_tokens": "min_tokens",
                                        "stop_token_ids": "stop_tokens"}
    assert not MinTokens.uses(MinTokens.Fields(min_tokens=0))
    assert MinTokens.uses(MinTokens.Fields(min_tokens=1))
    assert not MinTokens.uses(MinTokens.Fields())
    assert validated(SamplingParams(min_tokens=0)).fields == {}


# -- the torch path -----------------------------------------------------------------------


def test_torch_path_matches_reference_on_random_states() -> None:
    rng = random.Random(0)
    for trial in range(6):
        states = {slot: Slot(rng, VOCAB) for slot in rng.sample(range(8), 5)}
        proc = processor(states)
        slots = [rng.randrange(8) for _ in range(12)]
        logits = random_logits(len(slots), VOCAB, seed=trial)
        expected = reference(logits, slots, states)
        proc.apply(logits, torch.tensor(slots))
        assert torch.equal(logits, expected)


def test_update_counts_tokens_until_the_minimum() -> None:
    rng = random.Random(1)
    states = {slot: Slot(rng, VOCAB) for slot in range(6)}
    proc = processor(states)
    slots = torch.arange(8)  # slots 6 and 7 are not used: they count too, harmlessly
    for step in range(16):
        logits = random_logits(8, VOCAB, seed=100 + step)
        expected = reference(logits, list(range(8)), states)
        proc.apply(logits, slots)
        assert torch.equal(logits, expected), step
        proc.update(slots, logits.argmax(dim=-1))
        for state in states.values():
            state.num_output += 1


def test_torch_path_matches_transformers_min_new_tokens() -> None:
    rng = random.Random(2)
    states = {slot: Slot(rng, VOCAB) for slot in range(4)}
    states[0].num_output, states[0].min_tokens = 3, 4  # one row exactly one token short
    states[0].params.extra["min_tokens"] = 4
    proc = processor(states)
    logits = random_logits(4, VOCAB, seed=2)
    expected = []
    for row, state in states.items():
        prompt_len = 5
        hf = MinNewTokensLengthLogitsProcessor(prompt_len, state.min_tokens,
                                               sorted(state.mask_ids))
        input_ids = torch.zeros(1, prompt_len + state.num_output, dtype=torch.long)
        expected.append(hf(input_ids, logits[row:row + 1].clone()))
    proc.apply(logits, torch.arange(4))
    assert torch.equal(logits, torch.cat(expected))


def test_rows_not_using_it_are_untouched(kernel_device: torch.device) -> None:
    rng = random.Random(3)
    state = Slot(rng, VOCAB)
    state.num_output = 0
    proc = processor({1: state}, device=kernel_device)
    before = random_logits(4, VOCAB, seed=3)
    slots = torch.tensor([0, 1, 2, 7], device=kernel_device)
    logits = before.to(kernel_device, copy=True)
    proc.apply_torch(logits, slots)
    logits = logits.cpu()
    assert torch.equal(logits[[0, 2, 3]], before[[0, 2, 3]])
    assert logits[1, sorted(state.mask_ids)].eq(NEG_INF).all()
    triton_logits = before.to(kernel_device, copy=True)
    proc.apply_triton(triton_logits, slots)
    assert torch.equal(triton_logits.cpu(), logits)


def test_slot_reuse_after_remove_request_and_resume_after_preemption(
        kernel_device: torch.device) -> None:
    many = SamplingParams(min_tokens=50, max_tokens=64, stop_token_ids=list(range(100, 140)))
    other = SamplingParams(min_tokens=50, max_tokens=64)
    proc = make(4, device=kernel_device)
    proc.add_request(2, view(many, [1], []))
    proc.add_request(3, view(other, [1], []))
    assert proc.width == 41 and proc.mask_ids.shape[1] == 64  # grown past 16
    proc.remove_request(2)
    assert proc.width == 1
    before = random_logits(2, VOCAB, seed=4)
    expected = before.clone()
    expected[1, EOS] = NEG_INF
    logits, triton_logits = (before.to(kernel_device, copy=True) for _ in range(2))
    slots = torch.tensor([2, 3], device=kernel_device)
    proc.apply_torch(logits, slots)  # the freed slot 2 is left alone
    proc.apply_triton(triton_logits, slots)
    assert torch.equal(logits.cpu(), expected) and torch.equal(triton_logits.cpu(), expected)
    # Reused by a preempted sequence that had already drawn 3 of its 5 minimum tokens.
    resumed = SamplingParams(min_tokens=5, max_tokens=64, stop_token_ids=[9])
    proc.add_request(2, view(resumed, [1], [4, 5, 6]))
    slots = torch.tensor([2, 0], device=kernel_device)
    for step in range(4):
        logits = random_logits(2, VOCAB, seed=step).to(kernel_device)
        triton_logits = logits.clone()
        proc.apply_torch(logits, slots)
        proc.apply_triton(triton_logits, slots)
        held = logits[0, [EOS, 9]].eq(NEG_INF).all().item()
        assert held == (step < 2), step
        assert not logits[0, 100:140].eq(NEG_INF).any()  # nothing left of the old request
        assert torch.equal(triton_logits, logits)
        proc.update(slots, torch.tensor([7, 7], device=kernel_device))


# -- the Triton path (on CUDA, or the CPU through TRITON_INTERPRET=1) ---------------------
# Exact equality: the kernel only stores -inf. References are computed on the CPU.


@pytest.mark.parametrize("block", [4, 16])
def test_triton_path_matches_torch_path(block: int, kernel_device: torch.device) -> None:
    rng = random.Random(5)
    vocab = 64
    model = ModelInfo(vocab, frozenset({EOS}), 256)
    states = {slot: Slot(rng, vocab, max_stop_ids=10) for slot in (0, 2, 5)}
    states[5].stop_ids = list(range(10, 50))  # grows the id table past its first 16 columns
    states[5].params.extra["stop_token_ids"] = states[5].stop_ids
    states[5].num_output, states[5].min_tokens = 0, 3
    states[5].params.extra["min_tokens"] = 3
    proc = processor(states, num_slots=6, model=model, device=kernel_device)
    slots = torch.tensor([5, 0, 4, 2], device=kernel_device)
    logits = random_logits(4, vocab, seed=5)
    expected = reference(logits, slots.tolist(), states)
    torch_out = logits.to(kernel_device, copy=True)
    triton_out = torch_out.clone()
    proc.apply_torch(torch_out, slots)
    plugin.min_tokens_triton(triton_out, slots, proc.mask_ids, proc.num_mask_ids,
                             proc.num_generated, proc.min_tokens, block=block)
    assert torch.equal(torch_out.cpu(), expected)
    assert torch.equal(triton_out, torch_out)
    assert torch_out[0].isinf().sum() >= 40


KERNEL_SIGNATURE = {"logits_ptr": "*fp32", "row_stride": "i32", "slots_ptr": "*i64", "mask_ids_ptr": "*i64",
             "num_mask_ids_ptr": "*i32", "num_generated_ptr": "*i64", "min_tokens_ptr": "*i64",
             "state_stride": "i32", "BLOCK": "constexpr"}


@pytest.mark.gpu
def test_kernel_is_lazy_and_compiles_for_cuda() -> None:
    assert_kernel_is_lazy_and_compiles("freetoken_plugins.min_tokens", KERNEL_SIGNATURE, {"BLOCK": 16})


# -- in the engine ------------------------------------------------------------------------


def test_pipeline_runs_logit_bias_before_min_tokens() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, logit_bias={EOS: 100})
    PluginManager("min_tokens,logit_bias").validate(params, MODEL)  # names the classes too
    pipeline = ProcessorPipeline([MinTokens, LogitBias],
                                 ProcessorContext(2, MODEL, torch.device("cpu")))
    pipeline.add_request(0, Sequence(0, "0", [1], 1, params, seed=0, arrival=0, max_tokens=8,
                                     slot=0))
    logits = random_logits(1, VOCAB, seed=6)
    pipeline.apply(logits, torch.tensor([0]), post_temperature=False, all_greedy=True)
    assert logits[0, EOS].item() == NEG_INF


def test_end_to_end_min_tokens_holds_eos_back(tiny_llm: LLM) -> None:
    forced_eos = {"temperature": 0, "max_tokens": 16, "logit_bias": {EOS: 100}}
    alone = tiny_llm.generate("hello", SamplingParams(**forced_eos))[0].outputs[0]
    assert alone.token_ids == [EOS] and alone.finish_reason == "stop"
    outs = tiny_llm.generate(["hello", "hello", "hello"], [
        SamplingParams(**forced_eos, min_tokens=5),
        SamplingParams(**forced_eos, min_tokens=1),
        SamplingParams(**forced_eos)])
    held = outs[0].outputs[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == EOS
    assert EOS not in held.token_ids[:5] and held.finish_reason == "stop"
    assert outs[1].outputs[0].token_ids[1:] == [EOS] and len(outs[1].outputs[0].token_ids) == 2
    assert outs[2].outputs[0].token_ids == [EOS]  # the row without min_tokens is not held


def test_end_to_end_min_tokens_holds_stop_token_ids_back(tiny_llm: LLM) -> None:
    stop = 300
    out = tiny_llm.generate("hello", SamplingParams(
        temperature=0, max_tokens=16, min_tokens=3, stop_token_ids=[stop],
        logit_bias={stop: 100}))[0].outputs[0]
    assert out.token_ids[-1] == stop and len(out.token_ids) == 4
    assert stop not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # With ignore_eos, EOS stops nothing, so min_tokens does not hold it back.
    free = tiny_llm.generate("hello", SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True,
        logit_bias={EOS: 100}))[0].outputs[0]
    assert free.token_ids == [EOS] * 6 and free.finish_reason == "length"


def test_disabled_plugin_is_named(tiny_model_dir: Path, monkeypatch) -> None:
    llm = LLM(str(tiny_model_dir), plugins="logit_bias", kv_cache_tokens=4096, progress=False)
    with pytest.raises(InvalidRequest) as info:
        llm.generate("hi", SamplingParams(min_tokens=3))
    assert info.value.param == "min_tokens"
    assert "'min_tokens'" in info.value.message and "not enabled" in info.value.message
    assert llm.generate("hi", SamplingParams(max_tokens=2, logit_bias={1: 1}))[0].finished

    monkeypatch.setenv("FREETOKEN_PLUGINS", "none")
    manager = PluginManager()
    assert manager.enabled == set() and manager.processor_classes() == []
    with pytest.raises(InvalidRequest, match="plugin 'min_tokens'"):
        manager.validate(SamplingParams(min_tokens=3), MODEL)
    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_tokens,stop_tokens")
    assert PluginManager().processor_classes() == [MinTokens]


# -- the default model against transformers ------------------------------------------------

SHORT_ANSWERS = ["What is the capital of France?", "What is 2 + 2?",
                 "Is the sky blue? Answer yes or no."]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(None, dtype="float32", kv_cache_tokens=8192, progress=False)


@pytest.mark.slow
def test_default_model_matches_transformers_min_new_tokens(default_llm: LLM) -> None:
    from gguf_reference import hf_from_gguf

    from freetoken_core.tokenizer import apply_chat_template

    tok = default_llm.tokenizer
    prompts = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": c}]),
                          add_special_tokens=False) for c in SHORT_ANSWERS]
    natural = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    assert all(len(o.outputs[0].token_ids) < 20 and o.outputs[0].token_ids[-1] == EOS
               for o in natural)
    held = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                        min_tokens=20))
    hf = hf_from_gguf()
    for ids, out in zip(prompts, held):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          min_new_tokens=20)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        assert len(out.outputs[0].token_ids) > 20
        assert EOS not in out.outputs[0].token_ids[:20]
