"""The logit_bias plugin: validation, torch and Triton paths against references, engine runs."""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec
import pytest
import torch
from kernel_checks import assert_kernel_is_lazy_and_compiles
from transformers import SequenceBiasLogitsProcessor

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, ProcessorContext, RequestView, Stage
from freetoken_plugins import logit_bias as plugin
from freetoken_plugins.logit_bias import MAX_ENTRIES, LogitBias

VOCAB = 642
MODEL = ModelInfo(VOCAB, frozenset({2}), 2048)
BIG_MODEL = ModelInfo(151_936, frozenset({2}), 8192)
NEG_INF = float("-inf")

BAD_VALUES = [
    [1, 2], "42", 5, True, 1.5,                                      # not a mapping
    {-1: 1.0}, {VOCAB: 1.0}, {"-3": 1.0}, {str(VOCAB): 1.0},          # key out of range
    {"abc": 1.0}, {"4.2": 1.0}, {"": 1.0}, {" 4": 1.0}, {"9" * 30: 1.0},  # not an integer
    {4.0: 1.0}, {True: 1.0}, {None: 1.0}, {(4,): 1.0},
    {4: "5"}, {4: True}, {4: None}, {4: [1.0]}, {4: 1j},              # bias not a number
    {4: math.nan}, {4: math.inf}, {4: -math.inf},                     # bias not finite
    {"42": 1.0, 42: 2.0}, {"042": 1.0, 42: 2.0},                      # one token twice
    {i: 1.0 for i in range(MAX_ENTRIES + 1)},                         # too many entries
]


def bad_id(value: object) -> str:
    text = repr(value)
    return text if len(text) < 40 else f"{type(value).__name__}[{len(value)}]"


def field_of(param: str | None) -> str | None:
    """The top-level field a 400 names: ``logit_bias[...]`` (msgspec's path to a bad value
    inside the mapping) names ``logit_bias``."""
    return None if param is None else param.split("[")[0]


def validate(value: object, model: ModelInfo = MODEL) -> SamplingParams:
    """``SamplingParams(logit_bias=value)`` validated as the server validates it."""
    params = SamplingParams(logit_bias=value)
    PluginManager("logit_bias").validate(params, model)
    return params


def fields(bias: dict, model: ModelInfo = MODEL) -> LogitBias.Fields:
    """``bias`` as typed and validated fields."""
    return LogitBias.validate(msgspec.convert({"logit_bias": bias}, LogitBias.Fields), model,
                              SamplingParams(logit_bias=bias))


def make(num_slots: int, model: ModelInfo = MODEL, device: torch.device | str = "cpu"
         ) -> LogitBias:
    return LogitBias(ProcessorContext(num_slots, model, torch.device(device)))


def add(proc: LogitBias, slot: int, bias_fields: LogitBias.Fields) -> None:
    proc.add_request(slot, RequestView(str(slot), 0, bias_fields, SamplingParams(), [1, 2, 3],
                                       []))


def processor(biases: dict[int, dict[int, float]], num_slots: int = 8,
              device: torch.device | str = "cpu") -> LogitBias:
    """A LogitBias whose slot ``s`` holds ``biases[s]`` (validated as the engine would)."""
    proc = make(num_slots, device=device)
    for slot, bias in biases.items():
        bias_fields = fields(bias)
        if LogitBias.uses(bias_fields):
            add(proc, slot, bias_fields)
    return proc


def reference(logits: torch.Tensor, slots: list[int], biases: dict[int, dict[int, float]]
              ) -> torch.Tensor:
    """Row by row, token by token: logit += float32(clamped bias)."""
    out = logits.clone()
    for row, slot in enumerate(slots):
        for token, bias in biases.get(slot, {}).items():
            out[row, token] += torch.tensor(min(max(bias, -100.0), 100.0), dtype=torch.float32)
    return out


def random_biases(rng: random.Random, slots: list[int], vocab: int, max_entries: int = 40
                  ) -> dict[int, dict[int, float]]:
    return {slot: {t: rng.uniform(-150, 150) for t in rng.sample(range(vocab),
                                                                  rng.randint(1, max_entries))}
            for slot in slots}


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, 1:6] = NEG_INF  # masked tokens stay masked whatever their bias (0 is padding)
    return logits


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", BAD_VALUES, ids=bad_id)
def test_validation_rejects_bad_value(value) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(value)
    assert field_of(info.value.param) == "logit_bias"
    assert "logit_bias" in info.value.message


def test_generate_rejects_every_bad_value(tiny_llm: LLM) -> None:
    for value in BAD_VALUES:
        with pytest.raises(InvalidRequest) as info:
            tiny_llm.generate("hello", SamplingParams(logit_bias=value, max_tokens=2))
        assert field_of(info.value.param) == "logit_bias", value
    assert not tiny_llm.engine.has_unfinished_requests


def test_values_are_normalised_and_clamped() -> None:
    params = validate({"42": 3, 7: 250, 8: -1e300, 9: 10**400, "10": 0.5, 641: -100, 0: 0})
    expected = {42: 3.0, 7: 100.0, 8: -100.0, 9: 100.0, 10: 0.5, 641: -100.0, 0: 0.0}
    validated = params.fields["logit_bias"]
    assert validated.logit_bias == expected
    assert all(type(k) is int and type(v) is float for k, v in validated.logit_bias.items())
    assert LogitBias.validate(validated, MODEL, SamplingParams()).logit_bias == expected  # idempotent
    # What the engine process receives: the typed fields survive the wire unchanged.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(validated), type=LogitBias.Fields)
    assert wire.logit_bias == expected and all(type(k) is int for k in wire.logit_bias)


def test_limits_and_empty_mapping() -> None:
    full = validate({i: 1.0 for i in range(MAX_ENTRIES)}, BIG_MODEL)
    assert len(full.fields["logit_bias"].logit_bias) == MAX_ENTRIES
    empty = validate({})
    assert empty.fields == {}  # accepted, and the request does not use the processor
    assert not LogitBias.uses(LogitBias.Fields(logit_bias={}))
    assert LogitBias.uses(fields({1: 1})) and not LogitBias.uses(LogitBias.Fields())


def test_declared_traits() -> None:
    assert LogitBias.stage is Stage.BIAS and not LogitBias.argmax_invariant
    manager = PluginManager("logit_bias")
    assert manager.processor_classes() == [LogitBias] and LogitBias.name == "logit_bias"
    assert manager.field_owners() == {"logit_bias": "logit_bias"}


# -- the torch path -----------------------------------------------------------------------


def test_torch_path_matches_reference_on_random_histories() -> None:
    rng = random.Random(0)
    for trial in range(5):
        used = rng.sample(range(8), 5)
        biases = random_biases(rng, used, VOCAB)
        proc = processor(biases)
        slots = [rng.randrange(8) for _ in range(12)]  # rows may share a slot or not use it
        logits = random_logits(len(slots), VOCAB, seed=trial)
        expected = reference(logits, slots, biases)
        proc.apply(logits, torch.tensor(slots))
        assert torch.equal(logits, expected)
        assert proc.width == max(len(b) for b in biases.values())


def test_torch_path_matches_transformers_sequence_bias() -> None:
    rng = random.Random(1)
    biases = random_biases(rng, [0, 1, 2, 3], VOCAB)
    proc = processor(biases)
    logits = random_logits(4, VOCAB, seed=1)
    expected = []
    for row in range(4):
        hf = SequenceBiasLogitsProcessor(
            sequence_bias=[[[t], min(max(b, -100.0), 100.0)] for t, b in biases[row].items()])
        expected.append(hf(torch.tensor([[5, 6, 7]]), logits[row:row + 1].clone()))
    proc.apply(logits, torch.arange(4))
    assert torch.equal(logits, torch.cat(expected))


def test_rows_not_using_it_are_untouched(kernel_device: torch.device) -> None:
    proc = processor({1: {0: 50.0, 3: -7.0, 600: 2.0}, 5: {4: 1.0}}, device=kernel_device)
    before = random_logits(4, VOCAB, seed=2)
    slots = torch.tensor([0, 1, 2, 7], device=kernel_device)
    logits = before.to(kernel_device, copy=True)
    proc.apply_torch(logits, slots)
    logits = logits.cpu()
    assert torch.equal(logits[[0, 2, 3]], before[[0, 2, 3]])
    assert not torch.equal(logits[1], before[1])
    triton_logits = before.to(kernel_device, copy=True)
    proc.apply_triton(triton_logits, slots)
    assert torch.equal(triton_logits.cpu(), logits)


def test_slot_reuse_after_remove_request(kernel_device: torch.device) -> None:
    proc = processor({3: {t: 9.0 for t in range(0, 600, 7)}, 4: {11: 1.0, 12: 2.0}},
                     device=kernel_device)
    proc.remove_request(3)
    add(proc, 3, fields({5: -2.0}))
    assert proc.width == 2  # the removed slot's 86 entries no longer count
    slots = torch.tensor([3, 4], device=kernel_device)
    logits = random_logits(2, VOCAB, seed=3)
    expected = reference(logits, [3, 4], {3: {5: -2.0}, 4: {11: 1.0, 12: 2.0}})
    by_torch, by_triton = logits.to(kernel_device, copy=True), logits.to(kernel_device, copy=True)
    proc.apply_torch(by_torch, slots)
    proc.apply_triton(by_triton, slots)
    assert torch.equal(by_torch.cpu(), expected) and torch.equal(by_triton.cpu(), expected)
    proc.remove_request(3)  # slot 3 is free (or serves a request without logit_bias) ...
    logits = random_logits(2, VOCAB, seed=4)
    expected = reference(logits, [3, 4], {4: {11: 1.0, 12: 2.0}})
    by_torch, by_triton = logits.to(kernel_device, copy=True), logits.to(kernel_device, copy=True)
    proc.apply_torch(by_torch, slots)  # ... while slot 4 still keeps W > 0
    proc.apply_triton(by_triton, slots)
    assert torch.equal(by_torch.cpu(), expected) and torch.equal(by_triton.cpu(), expected)
    proc.remove_request(4)
    assert proc.width == 0
    again = expected.to(kernel_device, copy=True)
    proc.apply_triton(again, slots)
    assert torch.equal(again.cpu(), expected)


# -- the Triton path (on CUDA, or the CPU through TRITON_INTERPRET=1) ---------------------
# Exact equality: one float add per listed token, and the kernel launches without FP
# contraction (see kernel_checks). References are computed on the CPU.


@pytest.mark.parametrize("block", [16, 64])
def test_triton_path_matches_torch_path(block: int, kernel_device: torch.device) -> None:
    rng = random.Random(4)
    vocab = 64
    model = ModelInfo(vocab, frozenset({2}), 256)
    proc = make(6, model, kernel_device)
    biases = random_biases(rng, [0, 2, 5], vocab, max_entries=40)
    biases[2] = {t: rng.uniform(-150, 150) for t in range(vocab)}  # more entries than a block
    for slot, bias in biases.items():
        add(proc, slot, fields(bias, model))
    slots = torch.tensor([2, 0, 4, 5], device=kernel_device)
    logits = random_logits(4, vocab, seed=4)
    expected = reference(logits, slots.tolist(), biases)
    torch_out = logits.to(kernel_device, copy=True)
    triton_out = torch_out.clone()
    proc.apply_torch(torch_out, slots)
    plugin.logit_bias_triton(triton_out, slots, proc.token_ids, proc.biases, proc.num_entries,
                             block=block)
    assert torch.equal(torch_out.cpu(), expected)
    assert torch.equal(triton_out, torch_out)


KERNEL_SIGNATURE = {"logits_ptr": "*fp32", "row_stride": "i32", "slots_ptr": "*i64", "token_ids_ptr": "*i64",
             "biases_ptr": "*fp32", "num_entries_ptr": "*i32", "state_stride": "i32",
             "BLOCK": "constexpr"}


@pytest.mark.gpu
def test_kernel_is_lazy_and_compiles_for_cuda() -> None:
    assert_kernel_is_lazy_and_compiles("freetoken_plugins.logit_bias", KERNEL_SIGNATURE, {"BLOCK": 64})


# -- in the sampler and the engine ---------------------------------------------------------


def test_sampler_pipeline_forces_the_biased_token_when_sampling() -> None:
    manager = PluginManager("logit_bias")
    pipeline = ProcessorPipeline(manager.processor_classes(),
                                 ProcessorContext(4, MODEL, torch.device("cpu")))
    seqs = []
    for slot, bias in enumerate([{"77": 100}, None, {"77": 100}, None]):
        params = SamplingParams(temperature=1.0, top_p=0.9, logit_bias=bias)
        manager.validate(params, MODEL)
        seqs.append(Sequence(slot, str(slot), [5, 6], 2, params, seed=slot, arrival=slot,
                             max_tokens=8, slot=slot))
        pipeline.add_request(slot, seqs[-1])
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    logits[:, 77] = -10.0
    out = Sampler(pipeline)(logits, SamplingBatch.from_seqs(seqs, torch.device("cpu")))
    assert out.token_ids[0] == 77 and out.token_ids[2] == 77
    assert out.token_ids[1] != 77 and out.token_ids[3] != 77


def test_end_to_end_bias_steers_the_first_greedy_token(tiny_llm: LLM) -> None:
    prompt = "def add(a, b):"
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    natural = tiny_llm.generate(prompt, greedy)[0].outputs[0].token_ids
    chosen = next(t for t in range(100, VOCAB) if t not in natural)
    steered = tiny_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={str(chosen): 100}))
    assert steered[0].outputs[0].token_ids == [chosen] * 4
    banned = tiny_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={natural[0]: -100}))
    assert banned[0].outputs[0].token_ids[0] != natural[0]
    # A request without the field in the same batch is not affected.
    mixed = tiny_llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                       logit_bias={chosen: 100.0}), greedy])
    assert mixed[0].outputs[0].token_ids == [chosen] * 4
    assert mixed[1].outputs[0].token_ids == natural


def test_disabled_plugin_is_named(tiny_model_dir: Path, monkeypatch) -> None:
    llm = LLM(str(tiny_model_dir), plugins="none", kv_cache_tokens=4096, progress=False)
    with pytest.raises(InvalidRequest) as info:
        llm.generate("hi", SamplingParams(logit_bias={1: 1.0}))
    assert info.value.param == "logit_bias"
    assert "'logit_bias'" in info.value.message and "not enabled" in info.value.message
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].finished

    monkeypatch.setenv("FREETOKEN_PLUGINS", "stop_tokens")
    manager = PluginManager()
    assert manager.enabled == {"stop_tokens"} and LogitBias not in manager.processor_classes()
    with pytest.raises(InvalidRequest, match="plugin 'logit_bias'"):
        manager.validate(SamplingParams(logit_bias={1: 1.0}), MODEL)
    monkeypatch.setenv("FREETOKEN_PLUGINS", "logit_bias")
    manager = PluginManager()
    assert manager.processor_classes() == [LogitBias]
    params = SamplingParams(logit_bias={"1": 1})
    manager.validate(params, MODEL)
    assert params.fields["logit_bias"].logit_bias == {1: 1.0}


# -- the default model against transformers ------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me a short tip for staying focused while studying.",
]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(None, dtype="float32", kv_cache_tokens=8192, progress=False)


@pytest.mark.slow
def test_default_model_matches_transformers_sequence_bias(default_llm: LLM) -> None:
    from gguf_reference import hf_from_gguf

    from freetoken_core.tokenizer import apply_chat_template

    tok = default_llm.tokenizer
    prompts = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": c}]),
                          add_special_tokens=False) for c in CHATS]
    natural = [o.outputs[0].token_ids for o in default_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    # Per prompt: ban its 2nd natural token, pull up its 6th; one with JSON keys.
    biases = [{nat[1]: -100.0, nat[5]: 2.5} for nat in natural]
    params = [SamplingParams(temperature=0, max_tokens=32, logit_bias=b) for b in biases]
    params[0] = SamplingParams(temperature=0, max_tokens=32,
                               logit_bias={str(k): v for k, v in biases[0].items()})
    outs = default_llm.generate(prompts, params)
    hf = hf_from_gguf()
    for ids, bias, nat, out in zip(prompts, biases, natural, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          sequence_bias={(t,): b for t, b in bias.items()})
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids[:6] != nat  # the bias did change the generation
