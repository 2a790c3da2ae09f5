"""The example third-party plugin (examples/freetoken-ban-sequences), installed with pip.

The module fixture installs the example into the running environment and uninstalls it at
teardown, whatever happened in between. It installs a copy, not the checkout in editable
mode: a regular install lands in site-packages, where this already-running interpreter
(and any other one) can import it at once, whereas an editable install only works through
a ``.pth`` file that Python reads at start-up; and the checkout gets no build litter.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from pip_packages import pip_installed

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.bench import BenchShape, build_plugin_bench
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.testing import Harness

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "freetoken-ban-sequences"
DISTRIBUTION = "freetoken-ban-sequences"
FIELD = "ban_token_sequences"
VOCAB = 642  # the test tokenizer's
MODEL = ModelInfo(VOCAB, frozenset({2}), 2048)
CPU = torch.device("cpu")
PROMPT = "The quick brown fox jumps over the lazy dog. The"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    source = tmp_path_factory.mktemp("example") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    with pip_installed(source, DISTRIBUTION, "freetoken_ban_sequences") as module:
        yield module


@pytest.fixture(scope="module")
def llm(plugin: ModuleType, tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False)


def greedy(llm: LLM, prompts: list[str], **fields: object) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **fields)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def validated(sequences: object, model: ModelInfo = MODEL) -> SamplingParams:
    """``SamplingParams`` with ``ban_token_sequences``, validated as the server does."""
    params = SamplingParams(**{FIELD: sequences})
    PluginManager(plugins="ban_sequences").validate(params, model)
    return params


def processor(plugin: ModuleType, num_slots: int, vocab: int) -> Harness:
    """The installed plugin's processor, driven as the engine drives it (its token history
    included) by ``freetoken_core.testing.Harness``."""
    harness = Harness("ban_sequences", num_slots=num_slots, vocab=vocab, max_model_len=4096)
    assert isinstance(harness.processor, plugin.BanSequences)
    return harness


def add(proc: Harness, slot: int, sequences: list[list[int]], prompt: list[int],
        output: list[int]) -> None:
    assert proc.add(slot, {FIELD: sequences}, prompt, output)


def field_of(field: str) -> str:
    """``ban_token_sequences`` from a 400's param, which may point inside it (``[0][1]``)."""
    return field.split("[")[0]


# -- discovery ----------------------------------------------------------------------------


def test_plugin_manager_lists_the_installed_plugin(plugin: ModuleType) -> None:
    infos = {info.name: info for info in PluginManager().describe()}
    info = infos["ban_sequences"]
    assert info.enabled
    assert info.distribution == DISTRIBUTION and info.version == "0.1.0"
    assert info.kind == "processor" and info.hooks == []
    assert info.fields == [FIELD]
    assert info.description == "ban_token_sequences: never complete a banned token sequence."
    assert plugin.BanSequences in PluginManager().processor_classes()
    assert plugin.BanSequences.name == "ban_sequences"  # the entry point's name


def test_cli_lists_the_installed_plugin(plugin: ModuleType) -> None:
    done = subprocess.run([sys.executable, "-m", "freetoken_core.cli", "plugins", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    entry = next(p for p in json.loads(done.stdout) if p["name"] == "ban_sequences")
    assert entry["enabled"] is True
    assert entry["distribution"] == DISTRIBUTION
    assert entry["kind"] == "processor" and entry["fields"] == [FIELD]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_disabled_plugin_is_named(plugin: ModuleType, how: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("FREETOKEN_PLUGINS", "none")
        manager = PluginManager()
    else:
        manager = PluginManager(plugins="none")
    with pytest.raises(InvalidRequest) as err:
        manager.validate(SamplingParams(**{FIELD: [[5]]}), MODEL)
    assert err.value.param == FIELD
    assert "ban_sequences" in err.value.message
    assert validated([[5]]).fields["ban_sequences"].ban_token_sequences == [[5]]


# -- validation -----------------------------------------------------------------------------

BAD_VALUES = [
    5, "1,2", {"1": 2}, [1, 2], [[]], [[True]], [[1.0]], [[float("nan")]], [[float("inf")]],
    [["7"]], [[None]], [[-1]], [[VOCAB]], [[1] * 9], [[1]] * 33,
]


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_bad_value_is_refused_by_validation(plugin: ModuleType, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        validated(value)
    assert field_of(err.value.param) == FIELD


@pytest.mark.parametrize("value", [[[True]], [[VOCAB]], [[]], "x"], ids=repr)
def test_bad_value_is_refused_by_generate(llm: LLM, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        llm.generate(PROMPT, SamplingParams(max_tokens=2, **{FIELD: value}))
    assert field_of(err.value.param) == FIELD


def test_good_value_is_typed(plugin: ModuleType) -> None:
    params = validated(((1, 2), [VOCAB - 1]))
    fields = params.fields["ban_sequences"]
    assert isinstance(fields, plugin.BanSequences.Fields)
    assert fields.ban_token_sequences == [[1, 2], [VOCAB - 1]]


@pytest.mark.parametrize("value", [None, []], ids=repr)
def test_asking_for_nothing_does_not_use_the_plugin(plugin: ModuleType, value: object) -> None:
    assert "ban_sequences" not in validated(value).fields


# -- the processor against references -------------------------------------------------------


def reference(logits: torch.Tensor, histories: list[list[int]],
              banned: list[list[list[int]] | None]) -> tuple[torch.Tensor, int]:
    """The rule as a plain loop: ban a sequence's last token when its prefix ends the row.
    Also returns how many multi-token sequences matched."""
    out = logits.clone()
    num_multi = 0
    for row, (history, seqs) in enumerate(zip(histories, banned)):
        for seq in seqs or []:
            if len(seq) == 1 or history[-(len(seq) - 1):] == seq[:-1]:
                out[row, seq[-1]] = float("-inf")
                num_multi += len(seq) > 1
    return out, num_multi


def next_token(history: list[int], seq: list[int]) -> int:
    """The token of ``seq`` that extends the longest part of it that ends ``history``."""
    for j in range(len(seq) - 1, 0, -1):
        if history[-j:] == seq[:j]:
            return seq[j]
    return seq[0]


def random_case(rng: random.Random, vocab: int, history: list[int]) -> list[list[int]]:
    """Banned sequences for a row, about half of them primed to match its history."""
    seqs = []
    for _ in range(rng.randint(1, 6)):
        length = rng.randint(1, 8)
        if rng.random() < 0.5 and len(history) >= length - 1:
            prefix = history[len(history) - (length - 1):] if length > 1 else []
        else:
            prefix = [rng.randrange(vocab) for _ in range(length - 1)]
        seqs.append(prefix + [rng.randrange(vocab)])
    return seqs


def test_torch_path_matches_reference_and_transformers(plugin: ModuleType) -> None:
    from transformers import NoBadWordsLogitsProcessor

    rng = random.Random(0)
    vocab, rows = 64, 6
    proc = processor(plugin, 8, vocab)
    slots = torch.tensor([5, 0, 7, 2, 3, 1])
    histories, banned = [], []
    for i, slot in enumerate(slots.tolist()):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        seqs = None if i == 3 else random_case(rng, vocab, prompt + output)
        if seqs is not None:
            add(proc, slot, seqs, prompt, output)
        histories.append(prompt + output)
        banned.append(seqs)
    num_multi = 0
    for step in range(16):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step))
        expected, matched = reference(logits, histories, banned)
        got = logits.clone()
        proc.apply(got, slots)
        assert torch.equal(got, expected)
        num_multi += matched
        for row, (history, seqs) in enumerate(zip(histories, banned)):
            if seqs and len(history) >= 7:  # transformers skips prefixes longer than the input
                hf = NoBadWordsLogitsProcessor(seqs)(torch.tensor([history]), logits[row:row + 1])
                assert torch.equal(got[row:row + 1], hf)
        # Next tokens: mostly ones that walk along a banned sequence, so prefixes match.
        sampled = []
        for history, seqs in zip(histories, banned):
            token = rng.randrange(vocab)
            if seqs and rng.random() < 0.8:
                token = next_token(history, rng.choice(seqs))
            history.append(token)
            sampled.append(token)
        proc.update(slots, torch.tensor(sampled))
    assert num_multi >= 10  # the case did exercise multi-token matches


def test_rows_without_the_field_and_reused_slots(plugin: ModuleType) -> None:
    proc = processor(plugin, 4, 32)
    add(proc, 1, [[3], [4, 5]], [9, 4], [])
    slots = torch.arange(4)
    logits = torch.randn(4, 32)
    got = logits.clone()
    proc.apply(got, slots)
    assert torch.isinf(got[1, [3, 5]]).all()
    assert torch.equal(got[[0, 2, 3]], logits[[0, 2, 3]])
    proc.update(slots, torch.tensor([1, 7, 1, 1]))  # row 1 drew 7: [4, 5] no longer primed
    got = logits.clone()
    proc.apply(got, slots)
    assert torch.isinf(got[1, 3]) and got[1, 5] == logits[1, 5]
    # The slot goes to another request: nothing of the first one remains.
    proc.remove(1)
    got = logits.clone()
    proc.apply(got, slots)
    assert torch.equal(got, logits)
    add(proc, 1, [[2, 6], [7, 9]], [2], [])
    got = logits.clone()
    proc.apply(got, slots)
    expected = logits.clone()
    expected[1, 6] = float("-inf")  # not 9: the old request's 7 is gone; not 3 either
    assert torch.equal(got, expected)


def test_bench_plugin_runs_it(plugin: ModuleType) -> None:
    bench = build_plugin_bench("ban_sequences", BenchShape(batch=2, vocab=512, history=8),
                               num_steps=1)
    assert bench.notes == []
    assert [type(p).name for p in bench.active.pipeline.active()] == ["ban_sequences"]
    [proc] = bench.active.pipeline.processors
    assert proc.active.sum(dim=1).tolist() == [16, 16]  # BENCH_PARAMS: 16 sequences a row
    bench.active.reset()
    assert len(bench.active.run()) == 2


# -- end to end -----------------------------------------------------------------------------


def test_generation_avoids_banned_token_and_pair(llm: LLM) -> None:
    prompt_ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    baseline = greedy(llm, [PROMPT])[0]
    token = baseline[len(baseline) // 2]
    assert token in baseline
    banned, other_out = greedy(llm, [PROMPT, "A language model reads"], **{FIELD: [[token]]})
    assert token not in banned and token not in other_out

    a, b = baseline[1], baseline[2]
    out = greedy(llm, [PROMPT], **{FIELD: [[a, b]]})[0]
    seen = [prompt_ids[-1], *out]
    assert (a, b) not in set(itertools.pairwise(seen))
    assert out != baseline


def test_rows_without_the_field_are_unchanged_in_a_mixed_batch(llm: LLM) -> None:
    baseline = greedy(llm, [PROMPT])[0]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             **{FIELD: [[t] for t in sorted(set(baseline))[:4]]}),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    with_ban, without = (o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], params))
    assert with_ban != baseline
    assert without == baseline
