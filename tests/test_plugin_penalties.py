"""The penalties plugin: repetition (HF/CTRL), presence and frequency (OpenAI)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from kernel_checks import assert_kernel_is_lazy_and_compiles

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sequence import Sequence
from freetoken_core.history import TokenHistory
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, ProcessorContext, RequestView
from freetoken_core.testing import check_processor
from freetoken_plugins import penalties
from freetoken_plugins.penalties import (
    FIELDS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    Penalties,
)

CPU = torch.device("cpu")
FREQUENCY, PRESENCE, REPETITION = "frequency_penalty", "presence_penalty", "repetition_penalty"

BAD_VALUES = {
    REPETITION: [0, 0.0, -1.0, -0.5, float("nan"), float("inf"), -float("inf"), True, False,
                 "1.2", [1.2], {"a": 1}, 1e-50, 1e39, complex(1, 0),
                 # Outside [0.01, 100]: a subnormal penalty turned every logit into inf.
                 1e-39, 1e-30, 0.0099, 100.01, 1e30, 10**400, -(10**400)],
    PRESENCE: [2.01, -2.01, 3, float("nan"), float("inf"), -float("inf"), True, False, "0.5",
               [0.5], b"0.5", complex(0, 1), 10**400, -(10**400)],
    FREQUENCY: [2.5, -2.0001, -3, float("nan"), float("inf"), True, "1", (1.0,), {1.0},
                10**400],
}
BAD_CASES = [(f, v) for f, values in BAD_VALUES.items() for v in values]


def model_info(vocab: int = 64, max_model_len: int = 512) -> ModelInfo:
    return ModelInfo(vocab, frozenset({2}), max_model_len)


def params(rep: float | None = None, pres: float | None = None,
           freq: float | None = None) -> SamplingParams:
    return SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)


def fields(rep: float | None = None, pres: float | None = None,
           freq: float | None = None) -> Penalties.Fields:
    return Penalties.Fields(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)


def validated(request: SamplingParams, model: ModelInfo | None = None) -> SamplingParams:
    """``request`` after the server's validation: typed fields, then ``Penalties.validate``."""
    PluginManager("penalties").validate(request, model or model_info())
    return request


def make(num_slots: int, model: ModelInfo, device: torch.device | str = CPU) -> Penalties:
    """The processor with a token history of its own (the engine shares one: see the
    pipeline test below); ``add`` and ``draw`` keep it as the engine does."""
    history = TokenHistory(num_slots, model.max_model_len, torch.device(device))
    return Penalties(ProcessorContext(num_slots, model, torch.device(device), history=history))


def add(proc: Penalties, slot: int, penalty_fields: Penalties.Fields, prompt: list[int],
        output: list[int]) -> None:
    proc.history.add(slot, prompt, output)  # the engine fills the history first
    proc.add_request(slot, RequestView(str(slot), 0, penalty_fields, SamplingParams(),
                                       prompt, output))


def remove(proc: Penalties, slot: int) -> None:
    proc.remove_request(slot)
    proc.history.remove(slot)


def draw(update: Callable[..., None], slots: torch.Tensor, sampled: torch.Tensor,
         **update_options: int) -> None:
    """One step's tokens, in the engine's order: appended to the history, then ``update``."""
    update.__self__.history.append(slots, sampled)
    update(slots, sampled, **update_options)


def reference(logits: torch.Tensor, rows: list[tuple | None]) -> torch.Tensor:
    """Plain per-row loop over the distinct tokens: rows[i] = (prompt, output, rep, pres,
    freq) or None (row untouched)."""
    out = logits.clone()
    for r, row in enumerate(rows):
        if row is None:
            continue
        prompt, output, rep, pres, freq = row
        rep_t, pres_t, freq_t = (torch.tensor(v, dtype=torch.float32) for v in (rep, pres, freq))
        for token in set(prompt) | set(output):
            x = out[r, token]
            x = x * rep_t if x < 0 else x / rep_t
            count = output.count(token)
            if count > 0:
                x = x - pres_t
            x = x - freq_t * torch.tensor(float(count))
            out[r, token] = x
    return out


def random_case(rng: random.Random, vocab: int, num_slots: int, num_rows: int):
    """Rows on distinct random slots; some rows' slots do not use the processor."""
    slots = rng.sample(range(num_slots), num_rows)
    rows = []
    for i in range(num_rows):
        if i % 4 == 3:
            rows.append(None)
            continue
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        output = [rng.randrange(min(vocab, 20)) for _ in range(rng.randint(0, 30))]
        kind = i % 4
        rep = rng.uniform(0.5, 2.0) if kind != 1 else 1.0
        pres = rng.uniform(-2, 2) if kind != 2 else 0.0
        freq = rng.uniform(-2, 2)
        rows.append((prompt, output, rep, pres, freq))
    return slots, rows


def random_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, 0] = 0.0
    logits[:, 1] = -0.0
    logits[0, 5] = float("-inf")
    return logits


def add_rows(proc: Penalties, slots: list[int], rows: list[tuple | None], *,
             incremental: bool = False, path: str = "torch", **update_options: int) -> None:
    """Add each using row; with ``incremental`` the outputs arrive through ``update``."""
    for slot, row in zip(slots, rows):
        if row is not None:
            prompt, output, rep, pres, freq = row
            add(proc, slot, fields(rep, pres, freq), prompt, [] if incremental else output)
    if not incremental:
        return
    longest = max(len(r[1]) for r in rows if r is not None)
    for step in range(longest):
        # Every row is in the batch (unused slots too), as the engine does; rows whose
        # output is over draw a token that must not count (their slot is "done": remove).
        batch = [(s, r[1][step]) for s, r in zip(slots, rows) if r and step < len(r[1])]
        batch += [(s, 7) for s, r in zip(slots, rows) if r is None]
        draw(getattr(proc, f"update_{path}"),
             torch.tensor([b[0] for b in batch], device=proc.device),
             torch.tensor([b[1] for b in batch], device=proc.device), **update_options)


# -- validation --------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), BAD_CASES, ids=lambda v: repr(v)[:20])
def test_bad_values_are_rejected_by_the_type_and_the_manager(field: str, value: object) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):  # the published type refuses it
        msgspec.convert({field: value}, Penalties.Fields)
    with pytest.raises(InvalidRequest) as err:
        validated(SamplingParams(**{field: value}))
    assert err.value.param == field
    assert field in err.value.message


@pytest.mark.parametrize(("field", "value"), [(REPETITION, 0), (REPETITION, float("nan")),
                                              (PRESENCE, 2.5), (PRESENCE, True),
                                              (FREQUENCY, "1"), (FREQUENCY, float("-inf"))])
def test_bad_values_are_rejected_by_generate(tiny_llm: LLM, field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        tiny_llm.generate("Hello", SamplingParams(max_tokens=2, **{field: value}))
    assert err.value.param == field
    assert not tiny_llm.engine.has_unfinished_requests


def test_good_values_are_accepted_and_normalised_to_float() -> None:
    request = validated(SamplingParams(repetition_penalty=2, presence_penalty=-2,
                                       frequency_penalty=2))
    assert request.fields == {"penalties": fields(2.0, -2.0, 2.0)}
    assert all(type(getattr(request.fields["penalties"], f)) is float for f in FIELDS)
    for value in (MIN_REPETITION_PENALTY, 0.5, 1.0, 3, MAX_REPETITION_PENALTY):
        validated(SamplingParams(repetition_penalty=value))
    for value in (5e-324, -5e-324, 1e-300):  # subnormal / tiny additive penalties are harmless
        assert validated(SamplingParams(presence_penalty=value)).fields["penalties"] == fields(
            pres=value)


def test_repetition_penalty_bounds_keep_huge_logits_finite() -> None:
    """At both ends of the range a logit of 1e30 stays finite (1e-39 would give inf)."""
    proc = make(2, model_info(8))
    add(proc, 0, fields(MIN_REPETITION_PENALTY), [1, 2], [])
    add(proc, 1, fields(MAX_REPETITION_PENALTY), [1, 2], [])
    logits = torch.tensor([[0.0, 1e30, -1e30, 0, 0, 0, 0, 0]] * 2)
    proc.apply(logits, torch.tensor([0, 1]))
    assert torch.isfinite(logits).all()
    assert logits[0, 1] == pytest.approx(1e32, rel=1e-6)
    assert logits[1, 2] == pytest.approx(-1e32, rel=1e-6)


def test_uses_only_when_some_penalty_is_not_neutral() -> None:
    assert not Penalties.uses(fields())
    assert not Penalties.uses(fields(1.0, 0.0, 0.0))
    assert not Penalties.uses(msgspec.convert({REPETITION: 1, PRESENCE: 0, FREQUENCY: 0},
                                              Penalties.Fields))
    assert Penalties.uses(fields(rep=1.1))
    assert Penalties.uses(fields(pres=-0.1))
    assert Penalties.uses(fields(1.0, 0.0, 0.5))
    # The manager keeps the fields of using requests only: neutral ones never reach it.
    assert validated(params(1, 0, 0)).fields == {}
    assert validated(params(rep=1.1)).fields == {"penalties": fields(rep=1.1)}


# -- the math ------------------------------------------------------------------------------

@pytest.mark.parametrize("incremental", [False, True], ids=["built", "updated"])
def test_torch_path_matches_a_per_row_reference(incremental: bool) -> None:
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(5):
        vocab = rng.choice([32, 64, 100])
        proc = make(12, model_info(vocab))
        slots, rows = random_case(rng, vocab, 12, 8)
        add_rows(proc, slots, rows, incremental=incremental)
        logits = random_logits(gen, len(rows), vocab)
        expected = reference(logits, rows)
        assert not torch.equal(expected, logits)
        proc.apply(logits, torch.tensor(slots))
        assert torch.equal(logits, expected)


@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.3, 2.0])
def test_repetition_matches_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(int(penalty * 10))
    vocab, rows, length = 200, 6, 50
    input_ids = torch.randint(0, vocab, (rows, length), generator=gen)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    assert not torch.equal(expected, logits)
    proc = make(rows, model_info(vocab))
    for slot in range(rows):
        ids = input_ids[slot].tolist()
        split = 10 + 5 * slot  # HF's input_ids are prompt + generated, whatever the split
        add(proc, slot, fields(rep=penalty), ids[:split], ids[split:])
    proc.apply(logits, torch.arange(rows))
    assert torch.equal(logits, expected)


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    proc = make(2, model_info(16))
    add(proc, 0, fields(pres=0.5, freq=0.25), [3, 3, 4], [4, 5, 5, 5])
    logits = torch.ones(1, 16)
    proc.apply(logits, torch.tensor([0]))
    expected = torch.ones(1, 16)
    expected[0, 4] = 1 - 0.5 - 0.25  # generated once (its prompt occurrence does not count)
    expected[0, 5] = 1 - 0.5 - 0.75  # generated three times; token 3: prompt only, untouched
    assert torch.equal(logits, expected)


def test_state_size_and_count_dtype() -> None:
    big = make(256, ModelInfo(151_936, frozenset({2}), 32_768))
    assert big.capacity == 32_768 and big.counts.dtype == torch.int16
    assert big.state_bytes == 256 * 32_768 * 2 + 13 * 256  # counts, is_active, penalties
    assert big.history.state_bytes == 256 * 32_768 * 4 + 3 * 8 * 256  # shared, not its own
    assert big.state_bytes + big.history.state_bytes < 120e6
    del big
    long_ctx = make(2, ModelInfo(50_000, frozenset({2}), 40_000))
    assert long_ctx.capacity == 40_000 and long_ctx.counts.dtype == torch.int32


# -- Triton kernels (on CUDA, or the CPU through TRITON_INTERPRET=1) -----------------------
# Exact equality: the kernels launch without FP contraction (see kernel_checks), so each op
# rounds as torch's does. References are computed on the CPU.

def test_triton_apply_matches_torch_path(kernel_device: torch.device) -> None:
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    for block in (16, 256):
        proc = make(6, model_info(64), kernel_device)
        slots, rows = random_case(rng, 64, 6, 4)
        add_rows(proc, slots, rows)
        logits = random_logits(gen, 4, 64)
        by_torch = logits.to(kernel_device, copy=True)
        by_triton = by_torch.clone()
        on_device = torch.tensor(slots, device=kernel_device)
        proc.apply_torch(by_torch, on_device)
        penalties.penalties_apply_triton(
            by_triton, on_device, proc.history.token_ids, proc.history.lengths, proc.counts,
            proc.is_active, proc.penalties, proc.width, block=block)
        assert torch.equal(by_triton, by_torch)
        assert torch.equal(by_triton.cpu(), reference(logits, rows))


@pytest.mark.parametrize("block", [16, 1024])  # 16: the scan loops over several blocks
def test_triton_update_matches_torch_update(block: int, kernel_device: torch.device) -> None:
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    slots, rows = random_case(rng, 64, 6, 4)
    a, b = make(6, model_info(64)), make(6, model_info(64), kernel_device)
    add_rows(a, slots, rows, incremental=True)
    add_rows(b, slots, rows, incremental=True, path="triton", block=block)
    assert torch.equal(a.history.lengths, b.history.lengths.cpu())
    for slot, row in zip(slots, rows):  # tokens drawn by rows that do not use it: ignored
        n = 0 if row is None else len(row[0]) + len(row[1])
        assert int(a.history.lengths[slot]) == n
        distinct = 0 if row is None else len(set(row[0]) | set(row[1]))
        assert int((a.counts[slot, :n] >= 0).sum()) == distinct  # one first position each
        assert torch.equal(a.counts[slot, :n], b.counts[slot, :n].cpu())
    assert int(a.history.lengths.max()) <= a.width == b.width <= a.capacity
    logits = random_logits(gen, 4, 64)
    out = logits.to(kernel_device, copy=True)
    b.apply_triton(out, torch.tensor(slots, device=kernel_device))
    assert torch.equal(out.cpu(), reference(logits, rows))


APPLY_SIGNATURE = {"logits_ptr": "*fp32", "row_stride": "i32", "slots_ptr": "*i64",
                   "token_ids_ptr": "*i32", "lengths_ptr": "*i64", "counts_ptr": "*i16",
                   "is_active_ptr": "*i1", "penalties_ptr": "*fp32", "capacity": "i32",
                   "BLOCK": "constexpr"}


@pytest.mark.gpu
def test_apply_kernel_is_lazy_and_compiles_for_cuda_without_fma() -> None:
    assert_kernel_is_lazy_and_compiles("freetoken_plugins.penalties", APPLY_SIGNATURE,
                                       {"BLOCK": 256}, kernel="_kernels()[0]")


# -- slots ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["torch", "triton"])
def test_rows_of_other_slots_are_untouched(path: str, kernel_device: torch.device) -> None:
    proc = make(4, model_info(32), kernel_device)
    add(proc, 1, fields(2.0, 1.0, 1.0), list(range(32)), list(range(32)))
    add(proc, 2, fields(2.0, 1.0, 1.0), list(range(32)), [5, 6])
    remove(proc, 2)  # stale tokens stay in its history row; they must not be applied
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    logits[:, 0] = float("-inf")
    out = logits.to(kernel_device, copy=True)
    getattr(proc, f"apply_{path}")(out, torch.tensor([0, 1, 2], device=kernel_device))
    out = out.cpu()
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_slot_reuse_after_remove_forgets_the_old_request(path: str,
                                                         kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    proc = make(3, model_info(40), kernel_device)
    update = getattr(proc, f"update_{path}")
    one = torch.tensor([1], device=kernel_device)
    add(proc, 1, fields(1.8, 1.5, 0.7), [1, 2, 3, 4, 9, 9], [9, 9, 12, 13])
    draw(update, one, torch.tensor([20], device=kernel_device))
    remove(proc, 1)
    draw(update, one, torch.tensor([21], device=kernel_device))  # slot unused now
    add(proc, 1, fields(pres=0.3), [30, 31], [31])
    draw(update, one, torch.tensor([32], device=kernel_device))
    logits = torch.randn(1, 40, generator=gen)
    out = logits.to(kernel_device, copy=True)
    getattr(proc, f"apply_{path}")(out, one)
    assert torch.equal(out.cpu(), reference(logits, [([30, 31], [31, 32], 1.0, 0.3, 0.0)]))


def test_preempted_request_comes_back_with_its_outputs() -> None:
    proc = make(2, model_info(20))
    add(proc, 0, fields(1.5, 0.5, 0.5), [1, 2], [])
    for token in (3, 3, 2):
        draw(proc.update, torch.tensor([0]), torch.tensor([token]))
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(6))
    before = logits.clone()
    proc.apply(before, torch.tensor([0]))
    remove(proc, 0)  # preempted
    add(proc, 0, fields(1.5, 0.5, 0.5), [1, 2], [3, 3, 2])  # resumed
    after = logits.clone()
    proc.apply(after, torch.tensor([0]))
    assert torch.equal(before, after)
    assert torch.equal(after, reference(logits, [([1, 2], [3, 3, 2], 1.5, 0.5, 0.5)]))


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_schedule_matches_the_reference(seed: int) -> None:
    """freetoken_core.testing: mixed rows, rows without penalties, slot reuse, preemption and
    resume, through the engine's pipeline and token history."""
    def row(sent: dict) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
        rep, pres, freq = (sent.get(f, penalties.NEUTRAL[f]) for f in FIELDS)
        return lambda prompt, output, logits: reference(
            logits.unsqueeze(0), [(prompt, output, rep, pres, freq)])[0]

    report = check_processor("penalties", [{REPETITION: 1.5}, {PRESENCE: 0.7, FREQUENCY: 0.3},
                                           {REPETITION: 0.8, FREQUENCY: -0.5, PRESENCE: -1.0}],
                             row, seed=seed)
    # Presence and frequency wait for generated tokens; repetition acts from the prompt on.
    assert report.rows_checked > 100 and report.rows_changed > report.rows_checked * 0.9


def test_pipeline_runs_it_only_for_using_requests() -> None:
    manager = PluginManager("penalties")
    pipe = ProcessorPipeline(manager.processor_classes(), ProcessorContext(4, model_info(16), CPU))
    for slot, penalty in enumerate([1.0, 2.0]):
        request = SamplingParams(repetition_penalty=penalty)
        manager.validate(request, model_info(16))
        pipe.add_request(slot, Sequence(slot, str(slot), [1, 2], 2, request, seed=0,
                                        arrival=slot, max_tokens=4, slot=slot))
        assert [type(p) for p in pipe.active()] == ([] if slot == 0 else [Penalties])


# -- plugin wiring and end to end --------------------------------------------------------------

def test_plugin_registers_its_processor_and_fields() -> None:
    manager = PluginManager("penalties")
    assert manager.processor_classes() == [Penalties] and Penalties.name == "penalties"
    assert manager.field_owners() == dict.fromkeys(FIELDS, "penalties")
    assert manager.fields_types() == {"penalties": Penalties.Fields}
    info = {p.name: p for p in manager.describe()}["penalties"]
    assert info.enabled and info.kind == "processor" and set(info.fields) == set(FIELDS)
    assert info.hooks == []  # one class, no module-level hooks


def test_importing_the_plugin_does_not_import_triton() -> None:
    code = "import sys, freetoken_plugins.penalties; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def one_thread():
    """Run torch on one thread: on a shared CPU, a 2-thread pool waits for time slices at
    every op, and HF ``generate`` slows down several times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy(max_tokens: int, **extra: float) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def test_generate_repetition_matches_transformers_on_the_tiny_model(
        tiny_llm: LLM, tiny_model_dir: Path, one_thread: None) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [tiny_llm.engine.encode(t) for t in ("The quick brown", "A language model",
                                                   "Hello", "x")]
    plain_params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, plain_params)]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                     repetition_penalty=1.5))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          repetition_penalty=1.5)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert [o.outputs[0].token_ids for o in outs] != plain


def test_generate_presence_and_frequency_change_output_only_where_asked(
        tiny_llm: LLM, one_thread: None) -> None:
    prompt = "The quick brown"
    base = tiny_llm.generate(prompt, greedy(40))[0].outputs[0].token_ids
    mixed = tiny_llm.generate([prompt, prompt], [greedy(40, frequency_penalty=2.0,
                                                        presence_penalty=2.0), greedy(40)])
    penalised, plain = (o.outputs[0].token_ids for o in mixed)
    assert plain == base  # the row without penalties shares the batch, unchanged
    assert penalised != base
    # Each repeat of a token costs 2 + 2*count logits: the penalised run repeats less.
    assert len(set(penalised)) > len(set(base))
    assert max(penalised.count(t) for t in penalised) < max(base.count(t) for t in base)


def test_preempted_rows_keep_their_history_in_the_engine(tiny_model_dir: Path,
                                                         one_thread: None) -> None:
    """Penalties read the engine's token history: sequences preempted and recomputed (a
    small KV cache) draw what they draw without preemption, rows without penalties beside."""
    rng = random.Random(3)
    prompts = [[rng.randrange(7, 600) for _ in range(rng.randint(40, 90))] for _ in range(8)]
    params = [greedy(rng.randint(40, 60), **({} if i % 3 == 2 else
                                              {REPETITION: 1.3, FREQUENCY: 0.4 * (i % 2)}))
              for i in range(8)]
    expected = LLM(str(tiny_model_dir), kv_cache_tokens=8192, progress=False).generate(
        prompts, params)
    demand = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    small = LLM(str(tiny_model_dir), kv_cache_tokens=demand // 3, max_model_len=192,
                progress=False)
    outs = small.generate(prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_disabled_plugin_is_named_in_the_error(tiny_model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), plugins="none", kv_cache_tokens=2048, progress=False)
    for field in FIELDS:
        with pytest.raises(InvalidRequest) as err:
            llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 1.5}))
        assert err.value.param == field and "penalties" in err.value.message
    assert llm.generate("Hello", greedy(2))[0].outputs[0].finish_reason == "length"

    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_p")
    manager = PluginManager()
    assert "penalties" not in manager.enabled and Penalties not in manager.processor_classes()
    with pytest.raises(InvalidRequest) as err:
        manager.validate(params(rep=1.2), model_info())
    assert err.value.param == REPETITION and "penalties" in err.value.message
    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_p,penalties")
    PluginManager().validate(params(rep=1.2), model_info())  # enabled: accepted


# -- acceptance on the embedded default model -----------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits and their colours.",
    "Give me a short tip for staying focused while studying.",
]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(None, dtype="float32", kv_cache_tokens=8192, progress=False)


@pytest.mark.slow
def test_default_model_repetition_matches_transformers_generate(default_llm: LLM,
                                                                one_thread: None) -> None:
    from gguf_reference import hf_from_gguf

    from freetoken_core.tokenizer import apply_chat_template

    tok = default_llm.tokenizer
    prompt_ids = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": c}]),
                             add_special_tokens=False) for c in CHATS]
    outs = default_llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=32,
                                                           repetition_penalty=1.3))
    hf = hf_from_gguf()
    for ids, out in zip(prompt_ids, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          repetition_penalty=1.3)
        expected = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected
