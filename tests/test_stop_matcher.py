"""The Aho–Corasick stop matcher against a brute-force reference, on random texts and stop
sets split at random token boundaries."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from tiny_models import build_tokenizer

from freetoken_core.engine.output_processor import ChoiceText, StopMatcher
from freetoken_core.sampling_params import SamplingParams


def reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """``(start, stop)`` of the winner: the stop that completes first in ``text``; of those
    completing on the same character, the one that starts first. ``None``: no match."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
    return None


class ChunkDetokenizer:
    """Stands in for ``IncrementalDetokenizer``: token id ``i`` decodes to ``chunks[i]``."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    def add(self, ids: list[int]) -> str:
        return "".join(self.chunks[i] for i in ids)

    def finish(self) -> str:
        return ""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def run(tokenizer: Any, chunks: list[str], stops: list[str], include: bool,
        matcher: StopMatcher | None = None) -> tuple[ChoiceText, list[str], str | None]:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    choice = ChoiceText(tokenizer, [], params, matcher)
    choice.detokenizer = ChunkDetokenizer(chunks)  # type: ignore[assignment]
    released, matched = [], None
    for i in range(len(chunks)):
        matched = choice.add(i, finished=i == len(chunks) - 1)
        released.append(choice.released)
        if matched is not None:
            break
    return choice, released, matched


def test_matches_brute_force_on_random_texts_and_splits(tokenizer: Any) -> None:
    rng = random.Random(0)
    alphabet = "abcab é日🙂"  # small, so that stops overlap and nest often
    num_matched = 0
    for case in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 8))]
        include = case % 3 == 0
        want = reference(text, stops)
        matcher = StopMatcher(stops)
        for _ in range(3):  # the same text cut into tokens three different ways
            chunks = random_split(rng, text)
            choice, released, matched = run(tokenizer, chunks, stops, include, matcher)
            if want is None:
                assert matched is None and choice.text == choice.released == text
            else:
                start, stop = want
                cut = text[:start + (len(stop) if include else 0)]
                assert matched == stop, (text, stops, chunks)
                assert choice.text == choice.released == cut, (text, stops, chunks)
            for before, after in itertools.pairwise(released):
                assert after.startswith(before)
            assert all(choice.text.startswith(r) for r in released)
        num_matched += want is not None
    assert 200 < num_matched < 580  # both outcomes are exercised


def test_the_first_stop_to_complete_wins_whatever_the_split(tokenizer: Any) -> None:
    """"bc" completes before "abcd" although "abcd" starts first: one chunk or four."""
    for chunks in (["abcd"], list("abcd"), ["ab", "cd"]):
        choice, _, matched = run(tokenizer, chunks, ["abcd", "bc"], include=False)
        assert matched == "bc" and choice.text == "a"
    # Completing on the same character: the one that starts first (the longest).
    choice, _, matched = run(tokenizer, ["xabc"], ["c", "bc", "abc"], include=True)
    assert matched == "abc" and choice.text == "xabc"


def test_holds_back_the_longest_stop_minus_one(tokenizer: Any) -> None:
    choice, released, matched = run(tokenizer, list("hello wor"), ["world!", "zz"], False)
    assert matched is None and choice.hold == 5
    assert released[3] == ""  # "hell": 4 characters, all held
    assert released[-2] == "hel"  # "hello wo" minus 5, then everything at finish
    assert released[-1] == "hello wor"


def test_one_matcher_serves_several_choices(tokenizer: Any) -> None:
    matcher = StopMatcher(["END", "stop"])
    a, _, ma = run(tokenizer, list("to the END"), ["END", "stop"], False, matcher)
    b, _, mb = run(tokenizer, ["no ", "st", "op here"], ["END", "stop"], False, matcher)
    c, _, mc = run(tokenizer, ["nothing"], ["END", "stop"], False, matcher)
    assert (ma, a.text) == ("END", "to the ")
    assert (mb, b.text) == ("stop", "no ")
    assert (mc, c.text) == (None, "nothing")
    with pytest.raises(ValueError):
        ChoiceText(tokenizer, [], SamplingParams(stop=["other"]), matcher)


def test_tokens_after_a_match_are_ignored(tokenizer: Any) -> None:
    params = SamplingParams(stop=["x"])
    choice = ChoiceText(tokenizer, [], params)
    choice.detokenizer = ChunkDetokenizer(["ax", "more x"])  # type: ignore[assignment]
    assert choice.add(0, False) == "x"
    assert choice.add(1, True) is None
    assert choice.text == choice.released == "a" and choice.is_stopped


def test_many_stops_still_match_exactly() -> None:
    rng = random.Random(2)
    stops = sorted({"".join(rng.choice("abcd") for _ in range(rng.randint(3, 9)))
                    for _ in range(5000)})
    text = "".join(rng.choice("abcd") for _ in range(400))
    want = reference(text, stops)
    assert want is not None
    _, end, length = StopMatcher(stops).feed(0, text)
    assert (end + 1 - length, text[end + 1 - length:end + 1]) == want


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["a", ""])
