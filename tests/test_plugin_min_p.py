"""The min_p plugin: validation, torch and Triton paths against references, engine runs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from kernel_checks import assert_kernel_is_lazy_and_compiles
from transformers import MinPLogitsWarper

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, ProcessorContext, RequestView, Stage
from freetoken_plugins import min_p as plugin
from freetoken_plugins.min_p import MinP, min_p_torch, min_p_triton

VOCAB = 642
MODEL = ModelInfo(VOCAB, frozenset({2}), 2048)
NEG_INF = float("-inf")

BAD_VALUES = [True, False, -0.01, 1.0001, 2, -1, float("nan"), float("inf"), float("-inf"),
              "0.1", [0.1], {"min_p": 0.1}, 1e-3j,
              10**400, -(10**400)]  # JSON integers too large for a float: a 400, not a 500


def reference(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Row by row, from the definition: drop p_i < min_p * max(p), p = softmax (float64)."""
    out = logits.clone()
    for row, mp in enumerate(min_ps):
        if mp == 0:
            continue
        probs = logits[row].double().softmax(dim=-1)
        limit = mp * probs.max().item()
        for token in range(logits.shape[1]):
            if probs[token].item() < limit:
                out[row, token] = NEG_INF
    return out


def validated(params: SamplingParams) -> SamplingParams:
    """``params`` after the server's validation (``params.fields`` filled)."""
    PluginManager("min_p").validate(params, MODEL)
    return params


def make(num_slots: int) -> MinP:
    return MinP(ProcessorContext(num_slots, MODEL, torch.device("cpu")))


def add(proc: MinP, slot: int, min_p: float, prompt: list[int]) -> None:
    proc.add_request(slot, RequestView(str(slot), 0, MinP.Fields(min_p=min_p),
                                       SamplingParams(), prompt, []))


def processor(min_ps: list[float], num_slots: int = 8) -> tuple[MinP, torch.Tensor]:
    """A MinP with slot ``i`` holding ``min_ps[i]`` (0: not added), and those slots."""
    proc = make(num_slots)
    for slot, mp in enumerate(min_ps):
        if MinP.uses(MinP.Fields(min_p=mp)):
            add(proc, slot, mp, [1, 2, 3])
    return proc, torch.arange(len(min_ps))


def random_logits(rows: int, vocab: int, seed: int, num_masked: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    if num_masked:
        idx = torch.randint(0, vocab, (rows, num_masked), generator=gen)
        logits.scatter_(1, idx, NEG_INF)
    return logits


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_validation_rejects_bad_value(value) -> None:
    with pytest.raises(msgspec.ValidationError, match="min_p"):  # the published type refuses
        msgspec.convert({"min_p": value}, MinP.Fields)
    with pytest.raises(InvalidRequest) as info:
        validated(SamplingParams(min_p=value))
    assert info.value.param == "min_p"
    assert "min_p" in info.value.message


@pytest.mark.parametrize("value", [True, -0.5, 1.5, float("nan"), float("inf"), "0.1"], ids=repr)
def test_generate_rejects_bad_value(tiny_llm, value) -> None:
    with pytest.raises(InvalidRequest) as info:
        tiny_llm.generate("hello", SamplingParams(min_p=value, max_tokens=2))
    assert info.value.param == "min_p"


def test_good_values_are_normalised_to_float() -> None:
    for value, expected in [(0, 0.0), (1, 1.0), (0.25, 0.25), (1e-9, 1e-9),
                            (5e-324, 5e-324)]:
        typed = msgspec.convert({"min_p": value}, MinP.Fields).min_p
        assert type(typed) is float and typed == expected
        fields = validated(SamplingParams(min_p=value)).fields
        assert fields == ({} if expected == 0 else {"min_p": MinP.Fields(min_p=expected)})
    assert not MinP.uses(MinP.Fields(min_p=0.0))
    assert not MinP.uses(MinP.Fields(min_p=None))
    assert not MinP.uses(MinP.Fields())
    assert MinP.uses(MinP.Fields(min_p=0.01))


def test_subnormal_min_p_keeps_logits_finite() -> None:
    """The smallest positive min_p has a finite log: it masks nothing of a normal row."""
    proc = make(1)
    params = validated(SamplingParams(min_p=5e-324))
    proc.add_request(0, RequestView("0", 0, params.fields["min_p"], params, [1], []))
    assert torch.isfinite(proc.log_min_p[0])
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 100
    out = logits.clone()
    min_p_torch(out, torch.tensor([0]), proc.log_min_p)
    assert torch.equal(out, logits)


def test_declared_traits_and_hooks() -> None:
    assert MinP.stage is Stage.POST_TEMPERATURE and MinP.argmax_invariant
    manager = PluginManager("min_p")
    assert manager.processor_classes() == [MinP] and MinP.name == "min_p"
    assert manager.field_owners() == {"min_p": "min_p"}
    info = {p.name: p for p in manager.describe()}["min_p"]
    assert info.kind == "processor" and info.hooks == []
    assert plugin.BENCH_PARAMS == {"min_p": 0.05}


# -- the torch path -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_path_matches_reference_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    min_ps = [0.0, 1.0, 0.5, 0.05] + torch.rand(8, generator=gen).tolist()
    min_ps[6] = 0.0
    logits = random_logits(len(min_ps), 200, seed, num_masked=20)
    proc, slots = processor(min_ps, num_slots=16)
    # Rows are a permutation of slots: row i reads the state of slots[i].
    perm = torch.randperm(len(min_ps), generator=gen)
    got = logits[perm].clone()
    proc.apply(got, slots[perm])
    expected = reference(logits, min_ps)[perm]
    assert torch.equal(got, expected)
    kept = (got > NEG_INF).sum(dim=1)
    assert (kept >= 1).all() and (kept < (logits[perm] > NEG_INF).sum(dim=1)).any()


@pytest.mark.parametrize("min_p", [1e-4, 0.05, 0.1, 0.3, 0.9, 1.0])
def test_torch_path_matches_hf_min_p_warper(min_p: float) -> None:
    logits = random_logits(6, VOCAB, seed=int(min_p * 1e4), num_masked=50)
    proc, slots = processor([min_p] * 6)
    got = logits.clone()
    proc.apply(got, slots)
    hf = MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    assert torch.equal(got, hf)


def test_min_p_one_keeps_only_the_maximum_and_its_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, NEG_INF], [0.0, 0.0, 0.0, 0.0, 0.0]])
    proc, slots = processor([1.0, 1.0])
    proc.apply(logits, slots)
    assert torch.equal(logits, torch.tensor([[NEG_INF, 3.0, 3.0, NEG_INF, NEG_INF],
                                             [0.0, 0.0, 0.0, 0.0, 0.0]]))


def test_threshold_is_relative_to_the_top_probability() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps those >= 0.1.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    proc, slots = processor([0.2])
    proc.apply(logits, slots)
    assert (logits[0] > NEG_INF).tolist() == [True, True, True, False]


def test_rows_of_other_slots_are_untouched() -> None:
    logits = random_logits(5, 300, seed=7)
    proc, _ = processor([0.0, 0.5, 0.0, 0.0, 0.9], num_slots=5)
    slots = torch.tensor([0, 1, 2, 3, 4])
    got = logits.clone()
    proc.apply(got, slots)
    for row in (0, 2, 3):
        assert torch.equal(got[row], logits[row])
    for row in (1, 4):
        assert not torch.equal(got[row], logits[row])


def test_slot_reuse_after_remove_request() -> None:
    logits = random_logits(1, 300, seed=3)
    proc = make(4)
    slot = torch.tensor([2])
    add(proc, 2, 0.9, [5])
    first = logits.clone()
    proc.apply(first, slot)
    assert torch.equal(first, reference(logits, [0.9]))
    proc.remove_request(2)
    after_remove = logits.clone()
    proc.apply(after_remove, slot)
    assert torch.equal(after_remove, logits)
    add(proc, 2, 0.01, [5])
    second = logits.clone()
    proc.apply(second, slot)
    assert torch.equal(second, reference(logits, [0.01]))
    assert (second > NEG_INF).sum() > (first > NEG_INF).sum()


def test_state_is_one_float_per_slot() -> None:
    proc = make(64)
    assert proc.log_min_p.shape == (64,) and proc.log_min_p.dtype == torch.float32
    add(proc, 3, 0.25, [])
    assert proc.log_min_p[3].item() == pytest.approx(math.log(0.25))


# -- the Triton path (on CUDA, or the CPU through TRITON_INTERPRET=1) ---------------------
# Exact equality: a max, one float add and compares, launched without FP contraction (see
# kernel_checks).


@pytest.mark.parametrize(("rows", "vocab", "block"), [(4, 64, 64), (5, 100, 32), (3, 7, 16), (6, 2000, 256)])
def test_triton_matches_torch(rows: int, vocab: int, block: int,
                              kernel_device: torch.device) -> None:
    logits = random_logits(rows, vocab, seed=vocab, num_masked=3).to(kernel_device)
    log_min_p = torch.tensor([NEG_INF, math.log(0.3), 0.0, math.log(0.02), math.log(0.7),
                              NEG_INF], device=kernel_device)
    slots = torch.tensor([5, 1, 2, 3, 4, 0][:rows], device=kernel_device)
    expected = logits.clone()
    min_p_torch(expected, slots, log_min_p)
    got = logits.clone()
    min_p_triton(got, slots, log_min_p, block=block)
    assert torch.equal(got, expected)
    assert torch.equal(got[0], logits[0])  # slot 5 does not use min_p
    assert not torch.equal(got[1], logits[1])


def test_triton_on_a_row_slice_of_a_wider_batch(kernel_device: torch.device) -> None:
    base = random_logits(6, 64, seed=11).to(kernel_device)
    log_min_p = torch.full((6,), math.log(0.2), device=kernel_device)
    slots = torch.arange(3, device=kernel_device)
    expected = base.clone()
    min_p_torch(expected[::2], slots, log_min_p)
    got = base.clone()
    min_p_triton(got[::2], slots, log_min_p, block=32)
    assert torch.equal(got, expected)
    assert torch.equal(got[1::2], base[1::2])


KERNEL_SIGNATURE = {"logits_ptr": "*fp32", "row_stride": "i32", "slots_ptr": "*i64",
                    "log_min_p_ptr": "*fp32", "vocab": "i32", "BLOCK": "constexpr"}


@pytest.mark.gpu
def test_kernel_is_lazy_and_compiles_for_cuda() -> None:
    assert_kernel_is_lazy_and_compiles("freetoken_plugins.min_p", KERNEL_SIGNATURE,
                                       {"BLOCK": 2048}, kernel="_min_p_kernel()")


# -- in the sampler and the engine --------------------------------------------------------


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    """Sequences of validated ``params`` (which names the plugin classes, too)."""
    return [Sequence(seq_id=i, request_id=str(i), token_ids=[1, 2], num_prompt_tokens=2,
                     params=validated(p), seed=1000 + i, arrival=i, max_tokens=8, slot=i)
            for i, p in enumerate(params)]


def _pipeline(classes: list[type[MinP]], num_slots: int) -> ProcessorPipeline:
    return ProcessorPipeline(classes, ProcessorContext(num_slots, MODEL, torch.device("cpu")))


def test_sampler_draws_only_tokens_that_survive_min_p() -> None:
    params = [SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, min_p=0.3)]
    seqs = _seqs(params)
    pipeline = _pipeline([MinP], 8)
    for seq in seqs:
        pipeline.add_request(seq.slot, seq)
    sampler = Sampler(pipeline)
    logits = torch.zeros(3, 10)
    logits[:, 0] = 1.0  # p_0 = e * p_other: min_p 0.3 keeps tokens 0-4, min_p 1 only 0
    logits[2, 5:] = -5.0  # far below 0.3 * p_max: never drawn on row 2
    drawn: list[list[int]] = [[], [], []]
    for _ in range(40):
        out = sampler(logits.clone(), SamplingBatch.from_seqs(seqs, torch.device("cpu")))
        for row, token in enumerate(out.token_ids):
            drawn[row].append(token)
            seqs[row].token_ids.append(token)  # the next draw uses the next counter
    assert set(drawn[0]) == {0}
    assert len(set(drawn[1])) > 3 and max(drawn[1]) >= 5  # no min_p: everything drawable
    assert len(set(drawn[2])) > 1 and max(drawn[2]) < 5


def test_greedy_batches_skip_min_p() -> None:
    calls: list[int] = []

    class Counting(MinP):
        def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
            calls.append(logits.shape[0])
            super().apply(logits, slots)

    seqs = _seqs([SamplingParams(temperature=0.0, min_p=0.5)])
    pipeline = _pipeline([Counting], 4)
    pipeline.add_request(0, seqs[0])
    Sampler(pipeline)(torch.randn(1, 10), SamplingBatch.from_seqs(seqs, torch.device("cpu")))
    assert calls == []
    seqs[0].params = validated(SamplingParams(temperature=0.7, min_p=0.5))
    Sampler(pipeline)(torch.randn(1, 10), SamplingBatch.from_seqs(seqs, torch.device("cpu")))
    assert calls == [1]


def test_generate_min_p_one_samples_the_greedy_tokens(tiny_llm) -> None:
    prompt = [1, 100, 200, 300, 2, 1]
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    hot = {"temperature": 2.0, "max_tokens": 24, "ignore_eos": True, "seed": 7}
    plain = tiny_llm.generate(prompt, SamplingParams(**hot))[0].outputs[0].token_ids
    cut = tiny_llm.generate(prompt, SamplingParams(min_p=1.0, **hot))[0].outputs[0].token_ids
    assert plain != greedy  # at temperature 2 the random tiny model wanders off
    assert cut == greedy  # min_p = 1 leaves only the top token in every step


# -- plugin selection ---------------------------------------------------------------------


def test_disabled_plugin_names_itself(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), plugins="none", kv_cache_tokens=4096, progress=False)
    assert llm.generate([1, 5], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(InvalidRequest) as info:
        llm.generate([1, 5], SamplingParams(min_p=0.1, max_tokens=2))
    assert info.value.param == "min_p"
    assert "'min_p'" in info.value.message and "not enabled" in info.value.message


def test_freetoken_plugins_env_selects(monkeypatch) -> None:
    monkeypatch.setenv("FREETOKEN_PLUGINS", "none")
    with pytest.raises(InvalidRequest, match="plugin 'min_p'"):
        PluginManager().validate(SamplingParams(min_p=0.1), MODEL)
    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_p")
    manager = PluginManager()
    assert manager.enabled == {"min_p"}
    assert manager.processor_classes() == [MinP]
    params = SamplingParams(min_p=1)
    manager.validate(params, MODEL)
    assert params.fields["min_p"].min_p == 1.0
    with pytest.raises(InvalidRequest) as info:
        manager.validate(SamplingParams(min_p=3), MODEL)
    assert info.value.param == "min_p"
    # The engine option wins over the environment.
    assert "min_p" not in PluginManager(plugins="none").enabled
