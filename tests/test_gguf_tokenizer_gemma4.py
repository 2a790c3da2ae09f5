"""Gemma 4's GGUF tokenizer (``tokenizer.ggml.model = gemma4``) beyond the ids and pieces that
tests/test_gguf_tokenizer.py checks against llama.cpp's for it: which of llama.cpp's rules
the fixture exercises, BOS, the token types llama.cpp ends up with, what reloads."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from gguf_gemma4 import BOS, EOS
from gguf_tokenizer_cases import FIXTURE, gemma4_tokenizer_gguf, write_tokenizer_gguf

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf import end_of_generation_ids
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_tokenizer import (
    CONTROL,
    NORMAL,
    USER_DEFINED,
    GGUFVocab,
    build_tokenizer,
    llama_cpp_types,
    read_vocab,
)


@cache
def cases() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


def load(path: Path) -> GGUFVocab:
    return read_vocab(path, open_header(path))


@pytest.fixture(scope="module")
def lines_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma4_tokenizer_gguf("lines", tmp_path_factory.mktemp("gemma4"))[0]


def naive(vocab: GGUFVocab, ignore_merges: bool) -> Any:
    """A plain ``tokenizers`` BPE of ``vocab``: ``▁`` for spaces, the newline split, the
    file's merges and no rule for newline runs."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(ids, merges, byte_fallback=True,
                                     ignore_merges=ignore_merges))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), "isolated")
    return tokenizer


def test_the_fixture_exercises_llama_cpps_newline_and_merge_rules(lines_file: Path) -> None:
    """Gemma 4 has newline tokens but no merges for them: llama.cpp takes a run of newlines
    that is a token whole (plain BPE would not), but no other word (taking every word that is
    a token whole, ``ignore_merges``, would turn the line "<0x41>" into the byte "A")."""
    vocab = load(lines_file)
    expected = cases()["gemma4-lines"]
    for ignore_merges, key in ((False, "newlines"), (True, "literal")):
        tokenizer = naive(vocab, ignore_merges)
        text = expected["texts"][key]
        assert tokenizer.encode(text).ids != expected["ids"][key][1:], key
    newline = vocab.tokens.index("\n")
    assert vocab.tokens.index("\n\n\n") in expected["ids"]["newlines"]
    assert [newline] * 4 == expected["ids"]["newlines"][-4:]  # a run of 4: no token, no merge
    byte_newline = vocab.tokens.index("<0x0A>")
    assert byte_newline in cases()["gemma4-bytes"]["ids"]["newlines"]


def test_the_variants_tokenize_newlines_differently() -> None:
    runs = {case: cases()[case]["ids"]["newlines"] for case in cases() if "gemma4" in case}
    assert len({json.dumps(ids) for ids in runs.values()}) == 3


@pytest.mark.parametrize(("add_bos", "warns"), [(True, False), (None, False), (False, True)])
def test_bos_is_always_added(add_bos: bool | None, warns: bool, tmp_path: Path,
                             caplog: pytest.LogCaptureFixture) -> None:
    """llama.cpp overrides a false ``add_bos_token`` to true for Gemma 4, with a warning; the
    files have no ``tokenizer.ggml.pre`` (llama.cpp ignores it), which warns of nothing."""
    path, _ = gemma4_tokenizer_gguf("lines", tmp_path, add_bos=add_bos)
    with caplog.at_level(logging.WARNING):
        vocab = load(path)
        tokenizer = build_tokenizer(vocab)
    plain = tokenizer.encode("Hello", add_special_tokens=False).ids
    assert tokenizer.encode("Hello").ids == [BOS, *plain]
    assert ("add_bos_token" in caplog.text) is warns
    assert "tokenizer.ggml.pre" not in caplog.text
    assert vocab.pre is None


def test_decode_without_special_tokens_is_llama_cpps_pieces(lines_file: Path) -> None:
    """llama.cpp renders control tokens only with ``special``; ``<|tool_response>`` is
    user-defined in the file but ends generation, so it is control there too, and ``</s>`` is
    a normal token beside it. The other chat-parser tokens stay visible."""
    vocab = load(lines_file)
    tokenizer = build_tokenizer(vocab)
    text = cases()["gemma4-lines"]["texts"]["chat"]
    ids = cases()["gemma4-lines"]["ids"]["chat"]
    hidden = ("<bos>", "<|turn>", "<turn|>", "<eos>", "<|tool_response>")
    visible = text
    for token in hidden:
        visible = visible.replace(token, "")
    assert "<|channel>" in visible and "</s>" in visible and '<|"|>' in visible
    assert tokenizer.decode(ids, skip_special_tokens=True) == visible
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text  # BOS added


def test_end_of_generation_tokens(lines_file: Path) -> None:
    vocab = load(lines_file)
    eog = end_of_generation_ids(open_header(lines_file), vocab.tokens)
    assert [vocab.tokens[i] for i in eog] == ["<eos>", "<turn|>", "<|tool_response>"]
    assert eog[0] == EOS


def test_saved_tokenizer_reloads_and_tokenizes_alike(lines_file: Path) -> None:
    """The cached ``tokenizer.json`` (lookbehind regex and all) reloads, in ``tokenizers`` and
    in transformers' fast tokenizer, to the same ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    reloaded = Tokenizer.from_str(build_tokenizer(load(lines_file)).to_str())
    fast = PreTrainedTokenizerFast(tokenizer_object=reloaded, clean_up_tokenization_spaces=False)
    expected = cases()["gemma4-lines"]
    for key, text in expected["texts"].items():
        assert reloaded.encode(text).ids == expected["ids"][key], key
        assert fast(text)["input_ids"] == expected["ids"][key], key


def test_a_gemma4_file_without_merges_is_refused(lines_file: Path, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_models import _tokenizer_fields

    fields = [f for f in _tokenizer_fields(lines_file) if f[0] != "tokenizer.ggml.merges"]
    path = write_tokenizer_gguf(fields, tmp_path / "no-merges.gguf")
    with pytest.raises(ModelLoadError, match="without merges"):
        load(path)


def test_llama_cpp_types() -> None:
    """The types llama.cpp holds after loading: end-of-generation texts control, ``</s>``
    normal beside ``<|tool_response>``, gpt-oss's ``<|end|>`` and ``<|channel|>``
    user-defined."""
    tokens = ["<|im_end|>", "</s>", "<|tool_response>", "<|end|>", "<|return|>", "<|call|>",
              "<|channel|>", "hello"]
    vocab = GGUFVocab(model="gpt2", pre=None, tokens=tokens, types=[NORMAL] * len(tokens),
                      scores=[], merges=[], special_ids={}, add_bos=None, add_eos=None,
                      add_space_prefix=None)
    assert llama_cpp_types(vocab) == [CONTROL, NORMAL, CONTROL, USER_DEFINED, CONTROL, CONTROL,
                                      USER_DEFINED, NORMAL]
