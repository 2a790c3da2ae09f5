"""Incremental detokenization and stop strings, on the local byte-level BPE tokenizer."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from tiny_models import EOS_TOKEN, THINK_TOKENS, build_tokenizer

from freetoken_core.engine.output_processor import ChoiceText
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.tokenizer import IncrementalDetokenizer

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog.\n    return a + b  # done!",
    "accented": "café, naïve, Zürich, São Paulo, crème brûlée à Ærøskøbing",
    "greek-cyrillic": "Ελληνικά и русский текст",
    "cjk": "日本語 中文 한국어 漢字かな交じり文、東京都。",
    "emoji": "emoji 🙂🚀🦀 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 end",
    "mixed": "Paris 🗼 est très belle — 美しい! x²+y²=z² ∑∫√ \t tab",
    "fffd-free-edges": "é🙂",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer: Any, ids: list[int], prompt: list[int] | None = None,
           skip_special_tokens: bool = True) -> list[str]:
    """The deltas of feeding ``ids`` one at a time, the last one being ``finish()``."""
    detok = IncrementalDetokenizer(tokenizer, prompt or [], skip_special_tokens)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.finish())
    return deltas


# --------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("name", list(TEXTS))
def test_one_token_at_a_time_gives_the_full_decode(tokenizer: Any, name: str) -> None:
    text = TEXTS[name]
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", ["accented", "cjk", "emoji"])
def test_multibyte_characters_really_are_split_across_tokens(tokenizer: Any, name: str
                                                             ) -> None:
    """The interesting case is exercised: some single tokens decode to U+FFFD alone."""
    ids = encode(tokenizer, TEXTS[name])
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    # ...and the detokenizer waits on them instead of emitting anything broken.
    deltas = stream(tokenizer, ids)
    assert "" in deltas[:-1]


def test_deltas_are_released_promptly(tokenizer: Any) -> None:
    """ASCII text is released token by token (nothing waits for finish())."""
    ids = encode(tokenizer, TEXTS["ascii"])
    deltas = stream(tokenizer, ids)
    assert deltas[-1] == ""
    assert deltas[:-1] == [tokenizer.decode([i]) for i in ids]


def test_prompt_context_does_not_leak_into_the_output(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "User: Tell me about 日本語 and café 🙂\nAssistant:")
    for name in ("ascii", "cjk", "emoji", "mixed"):
        ids = encode(tokenizer, " " + TEXTS[name])
        deltas = stream(tokenizer, ids, prompt=prompt)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_random_unicode_strings(tokenizer: Any) -> None:
    rng = random.Random(0)
    alphabet = list("abc xyz.,\n") + list("éüßøñ") + list("日本語中文한국") + list("🙂🚀🦀👍")
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = encode(tokenizer, text)
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_chunks_of_several_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, TEXTS["mixed"] + TEXTS["emoji"])
    for size in (2, 3, 5):
        detok = IncrementalDetokenizer(tokenizer, [])
        out = "".join(detok.add(ids[i:i + size]) for i in range(0, len(ids), size))
        out += detok.finish()
        assert out == tokenizer.decode(ids)


def test_finish_flushes_an_incomplete_character(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 🙂")
    assert "\ufffd" in tokenizer.decode(ids[:-1])
    deltas = stream(tokenizer, ids[:-1])  # generation cut in the middle of the emoji
    assert "".join(deltas) == tokenizer.decode(ids[:-1])
    assert deltas[-1] != ""  # the broken tail came out only at finish()
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add(ids)
    assert detok.finish() == "" and detok.finish() == ""


def test_skip_special_tokens_drops_im_end_but_keeps_think(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    think, end_think = (tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS)
    ids = ([think] + encode(tokenizer, "hmm, café") + [end_think]
           + encode(tokenizer, " Answer 🙂") + [eos])
    skipped = "".join(stream(tokenizer, ids, skip_special_tokens=True))
    assert skipped == "<think>hmm, café</think> Answer 🙂"
    assert EOS_TOKEN not in skipped
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "<think>hmm, café</think> Answer 🙂" + EOS_TOKEN
    # The skipped token produces no delta of its own.
    assert stream(tokenizer, ids, skip_special_tokens=True)[-2] == ""


# --------------------------------------------------------------------------- stop strings


def run_choice(tokenizer: Any, text: str, stop: list[str], include: bool = False,
               prompt: str = "Q:") -> tuple[ChoiceText, list[str], list[str], str | None]:
    """Feed ``text`` token by token until a stop matches (the engine then ends the choice).

    Returns the ChoiceText, its ``text`` and ``released`` after each token, and the match.
    """
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    choice = ChoiceText(tokenizer, encode(tokenizer, prompt), params)
    ids = encode(tokenizer, text)
    texts: list[str] = []
    released: list[str] = []
    matched = None
    for n, tok in enumerate(ids):
        finished = n == len(ids) - 1
        matched = choice.add(tok, finished)
        texts.append(choice.text)
        released.append(choice.released)
        if matched is not None:
            break
    return choice, texts, released, matched


def assert_released_invariants(texts: list[str], released: list[str], stop: list[str],
                               final_done: bool = True) -> None:
    for before, after in itertools.pairwise(released):
        assert after.startswith(before), "released text shrank or changed"
    for text, rel in zip(texts, released):
        assert text.startswith(rel)
    # Before the end, no partial stop string at the end of the text is ever released.
    last = len(texts) - 1 if final_done else len(texts)
    for text, rel in zip(texts[:last], released[:last]):
        for s in stop:
            for k in range(1, len(s)):
                if text.endswith(s[:k]):
                    assert len(rel) <= len(text) - k, (text, rel, s)


def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = ["brown fox"]
    ids = encode(tokenizer, text)
    first = next(i for i in range(len(ids)) if "brown fox" in tokenizer.decode(ids[:i + 1]))
    assert "brown fox" not in tokenizer.decode([ids[first]])  # really spans tokens
    choice, texts, released, matched = run_choice(tokenizer, text, stop)
    assert matched == "brown fox"
    assert len(texts) == first + 1  # found on the token that completed it
    assert choice.text == choice.released == "The quick "
    assert all("brown" not in r for r in released)
    assert_released_invariants(texts, released, stop)


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    choice, texts, released, matched = run_choice(tokenizer, text, ["brown fox"], include=True)
    assert matched == "brown fox"
    assert choice.released == choice.text == "The quick brown fox"
    assert_released_invariants(texts, released, ["brown fox"])


def test_partial_stop_string_is_held_back_then_released(tokenizer: Any) -> None:
    text = "Hello world and the wor"  # "world!" never completes
    stop = ["world!"]
    choice, texts, released, matched = run_choice(tokenizer, text, stop)
    assert matched is None
    assert_released_invariants(texts, released, stop)
    # Mid-stream the tail that could begin "world!" was withheld...
    held = [(t, r) for t, r in zip(texts[:-1], released[:-1]) if t.endswith(("wor", "world"))]
    assert held and all(not r.endswith(("w", "wo", "wor", "worl", "world")) for _, r in held)
    # ...and at finish everything is released.
    assert choice.released == choice.text == text


def test_no_stop_strings_releases_everything_at_once(tokenizer: Any) -> None:
    text = TEXTS["ascii"]
    choice, texts, released, matched = run_choice(tokenizer, text, [])
    assert matched is None and choice.released == text
    assert released == texts


def test_first_completed_stop_wins(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    # Both complete on the same character; the one that starts first wins, not list order.
    choice, _, _, matched = run_choice(tokenizer, text, ["ox", "fox", "x j"])
    assert matched == "fox"
    assert choice.released == "The quick brown "
    # A stop completed earlier in the stream wins over a later one.
    choice, _, _, matched = run_choice(tokenizer, text, ["lazy", "over"])
    assert matched == "over" and choice.released == "The quick brown fox jumps "


def test_first_completed_stop_wins_inside_one_delta(tokenizer: Any) -> None:
    """Two stops completed by one multi-character delta: the one completing first cuts."""
    text = "ab 日本語 cd"
    ids = encode(tokenizer, text)
    stops = ["本語", "日本"]
    choice, texts, released, matched = run_choice(tokenizer, text, stops)
    assert matched == "日本"
    assert choice.released == choice.text == "ab "
    assert_released_invariants(texts, released, stops)
    assert len(texts) < len(ids)


def test_stop_string_made_of_multibyte_characters(tokenizer: Any) -> None:
    text = "Voilà: café 🙂🚀 et 🦀 fin"
    stop = ["🙂🚀"]
    choice, texts, released, matched = run_choice(tokenizer, text, stop)
    assert matched == "🙂🚀"
    assert choice.released == "Voilà: café "
    assert not any("\ufffd" in r for r in released)
    assert_released_invariants(texts, released, stop)
    choice, _, _, matched = run_choice(tokenizer, text, stop, include=True)
    assert choice.released == "Voilà: café 🙂🚀"


def test_stop_string_at_the_very_start(tokenizer: Any) -> None:
    choice, _, released, matched = run_choice(tokenizer, "STOP and more", ["STOP"])
    assert matched == "STOP" and choice.released == "" and choice.text == ""
    assert all(r == "" for r in released)


def test_stop_on_the_last_token_and_finish_together(tokenizer: Any) -> None:
    text = "count to ten"
    choice, _, _, matched = run_choice(tokenizer, text, ["ten"])
    assert matched == "ten" and choice.released == "count to "


def test_several_stops_of_different_lengths_hold_by_the_longest(tokenizer: Any) -> None:
    text = "a cat, a bird and an old computer that could still count to ten"
    stop = ["zz", "computer that can", "\n\n"]
    choice, texts, released, matched = run_choice(tokenizer, text, stop)
    assert matched is None
    assert_released_invariants(texts, released, stop)
    assert choice.released == text
    # "computer that" was held back while "computer that can" was still possible.
    mid = [r for t, r in zip(texts, released) if t.endswith("computer that")]
    assert mid and all("computer" not in r for r in mid)


def test_random_texts_and_stops_never_release_what_is_cut(tokenizer: Any) -> None:
    rng = random.Random(1)
    words = ["the", "fox", " ", "é", "日本", "🙂", "ab", "\n", "x", "cat"]
    num_matched = 0
    for _ in range(80):
        text = "".join(rng.choice(words) for _ in range(rng.randint(3, 25)))
        stop = ["".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
                for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.3
        choice, texts, released, matched = run_choice(tokenizer, text, stop, include, "")
        assert_released_invariants(texts, released, stop)
        # Expected: the first delta after which some stop occurs ends the choice, cut at the
        # stop that completes first (of those completing together, the one starting first).
        deltas = stream(tokenizer, encode(tokenizer, text))
        so_far = ""
        want_text, want_stop = text, None
        for delta in deltas:
            so_far += delta
            found = [(so_far.find(s) + len(s), -len(s), s) for s in stop if s in so_far]
            if found:
                end, _, want_stop = min(found)
                want_text = so_far[:end - (0 if include else len(want_stop))]
                break
        assert so_far.startswith(want_text)
        assert matched == want_stop, (text, stop)
        assert choice.released == choice.text == want_text, (text, stop)
        assert all(want_text.startswith(r) for r in released)
        num_matched += matched is not None
    assert 20 < num_matched < 80  # both outcomes are exercised


def test_request_state_exposes_only_released_text(tokenizer: Any) -> None:
    from freetoken_core.engine.core import SeqUpdate
    from freetoken_core.engine.output_processor import RequestState

    params = SamplingParams(stop=["lazy dog"], n=1)
    prompt = encode(tokenizer, "Q:")
    state = RequestState("r", "Q:", prompt, params, tokenizer)
    ids = encode(tokenizer, "over the lazy dog again")
    seen = []
    matched = None
    for tok in ids:
        update = SeqUpdate("r", 0, tok, None, None, None, 0)
        matched = state.apply(update)
        seen.append(state.output.outputs[0].text)
        if matched:
            break
    assert matched == "lazy dog"
    out = state.output.outputs[0]
    assert out.text == "over the " and out.finish_reason == "stop" and out.stop_reason == "lazy dog"
    assert all("lazy" not in s for s in seen)
