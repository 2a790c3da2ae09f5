"""FreeToken's tokenizer of a GGUF file tokenizes as llama.cpp does (issue #34).

The oracle is tests/fixtures/gguf_tokenizer_ids.json: llama.cpp's ids (``llama-tokenize``,
add_special and parse_special, as llama-server tokenizes a prompt) for the texts of
tests/gguf_tokenizer_cases.py over the default model's vocabulary re-labelled with each
``tokenizer.ggml.pre`` type, over two SentencePiece models and over three Gemma 4
(``gemma4``) BPE vocabularies trained in the test. Decoding
is checked against llama.cpp's pieces (``llama_vocab::token_to_piece``) computed here, and
streaming against the incremental detokenizer."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from gguf_tokenizer_cases import (
    FIXTURE,
    GPL3,
    case_texts,
    special_texts,
    vocabularies,
    write_tokenizer_gguf,
)

from freetoken_core.models.gguf_pretokenizers import PRE_TOKENIZERS
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_tokenizer import (
    BYTE,
    CONTROL,
    UNKNOWN,
    USER_DEFINED,
    GGUFVocab,
    build_tokenizer,
    read_vocab,
)
from freetoken_core.tokenizer import IncrementalDetokenizer


@cache
def fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return vocabularies(tmp_path_factory.mktemp("gguf-tokenizers"))


@pytest.fixture(scope="module")
def built(vocab_files: dict[str, tuple[Path, str]]) -> dict[str, tuple[GGUFVocab, Any]]:
    """Case name -> (the file's vocabulary, FreeToken's tokenizer of it)."""
    out = {}
    for name, (path, _) in vocab_files.items():
        vocab = read_vocab(path, open_header(path))
        out[name] = (vocab, build_tokenizer(vocab))
    return out


def first_difference(tokenizer: Any, ours: list[int], theirs: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
             min(len(ours), len(theirs)))
    window = slice(max(i - 3, 0), i + 4)
    pieces = [[tokenizer.id_to_token(t) for t in ids[window]] for ids in (ours, theirs)]
    return (f"lengths {len(ours)} vs {len(theirs)}, first difference at {i}: "
            f"{pieces[0]} {ours[window]} vs llama.cpp {pieces[1]} {theirs[window]}")


CASES = sorted(fixture()["cases"])


def test_fixture_covers_every_listed_pre_type_and_both_spm_prefixes() -> None:
    for pre in ("default", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "smollm",
                "gpt-4o", "tekken"):
        assert f"bpe-{pre}" in CASES
    assert {"spm-True", "spm-False", "spm-phi3"} <= set(CASES)
    assert {"gemma4-lines", "gemma4-merged", "gemma4-bytes"} <= set(CASES)
    assert all(len(c["ids"]) == len(c["texts"]) >= 12 for c in fixture()["cases"].values())


@pytest.mark.parametrize("case", CASES)
def test_ids_equal_llama_cpp(case: str, built: dict[str, tuple[GGUFVocab, Any]],
                             vocab_files: dict[str, tuple[Path, str]]) -> None:
    expected = fixture()["cases"][case]
    assert vocab_files[case][1] == expected["vocab_sha256"], (
        "the vocabulary differs from the fixture's (sentencepiece trained another model?); "
        "regenerate it: see tests/gguf_tokenizer_cases.py")
    vocab, tokenizer = built[case]
    assert case_texts(case, special_texts(vocab)) == expected["texts"]
    for key, text in expected["texts"].items():
        ours = tokenizer.encode(text, add_special_tokens=True).ids
        theirs = expected["ids"][key]
        assert ours == theirs, (case, key, first_difference(tokenizer, ours, theirs))


def test_the_pre_types_tokenize_differently() -> None:
    """The fixture holds no copy-paste: the types differ where their regexes do."""
    ids = {case: json.dumps(c["ids"]) for case, c in fixture()["cases"].items()}
    assert ids["bpe-llama-bpe"] == ids["bpe-llama3"]
    assert ids["bpe-qwen2"] == ids["bpe-deepseek-r1-qwen"]
    distinct = {ids[f"bpe-{p}"] for p in ("default", "llama3", "qwen2", "smollm", "gpt-4o",
                                          "tekken", "gpt-2")}
    assert len(distinct) == 7


def byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (llama.cpp's ``unicode_utf8_to_byte``)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(extra)})
    return chars


def llama_cpp_pieces(vocab: GGUFVocab, ids: list[int]) -> str:
    """llama.cpp's ``token_to_piece`` (special=true) of each id, concatenated: byte-level
    text back to its bytes (BPE), ``▁`` as a space and byte tokens as their byte
    (SentencePiece, Gemma 4), control / unknown / user-defined tokens as their text."""
    to_byte = byte_level_bytes()
    out = b""
    for i in ids:
        text, kind = vocab.tokens[i], vocab.types[i]
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            out += text.encode()
        elif kind == BYTE:
            out += bytes([int(text[3:5], 16)])
        elif vocab.is_spm or vocab.model == "gemma4":
            out += text.replace("▁", " ").encode()
        else:
            out += bytes(to_byte[c] for c in text)
    return out.decode("utf-8", "replace")


@pytest.mark.parametrize("case", CASES)
def test_decode_is_llama_cpp_pieces_and_inverts_encode(
        case: str, built: dict[str, tuple[GGUFVocab, Any]]) -> None:
    vocab, tokenizer = built[case]
    strip = vocab.is_spm and vocab.add_space_prefix is not False
    for key, text in fixture()["cases"][case]["texts"].items():
        ids = fixture()["cases"][case]["ids"][key]
        body = ids[1:] if ids[:1] == [vocab.special_ids.get("bos")] else ids
        pieces = llama_cpp_pieces(vocab, body)
        if strip and pieces.startswith(" "):
            pieces = pieces[1:]  # the space prefix the encoder added, as llama_detokenize
        assert tokenizer.decode(body, skip_special_tokens=False) == pieces, (case, key)
        # decode inverts encode, except for the space a SentencePiece prefix adds after
        # each special token (llama.cpp's too)
        if not (strip and key in ("specials", "mixed")):
            assert pieces == text, (case, key)


@pytest.mark.parametrize("case", ["bpe-smollm", "bpe-qwen2", "spm-True", "spm-False",
                                  "gemma4-lines"])
def test_streaming_never_emits_a_split_character(
        case: str, built: dict[str, tuple[GGUFVocab, Any]]) -> None:
    from transformers import PreTrainedTokenizerFast

    backend = built[case][1]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend,
                                        clean_up_tokenization_spaces=False)
    text = fixture()["cases"][case]["texts"]["emoji"] + fixture()["cases"][case]["texts"]["cjk"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some pieces are partial
    detok = IncrementalDetokenizer(tokenizer, ids[:1])
    deltas = [detok.add([i]) for i in ids[1:]]
    deltas.append(detok.finish())
    assert not any("\ufffd" in d for d in deltas)
    assert tokenizer.decode(ids[:1]) + "".join(deltas) == tokenizer.decode(ids) == text


def test_unknown_pre_type_warns_and_splits_as_default(
        tmp_path: Path, vocab_files: dict[str, tuple[Path, str]],
        caplog: pytest.LogCaptureFixture) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_models import _tokenizer_fields

    fields = [(k, "no-such-pre" if k == "tokenizer.ggml.pre" else v, kind)
              for k, v, kind in _tokenizer_fields(vocab_files["bpe-default"][0])]
    path = write_tokenizer_gguf(fields, tmp_path / "unknown-pre.gguf")
    with caplog.at_level(logging.WARNING, logger="freetoken_core.models.gguf_tokenizer"):
        tokenizer = build_tokenizer(read_vocab(path, open_header(path)))
    assert "'no-such-pre'" in caplog.text
    expected = fixture()["cases"]["bpe-default"]
    for key, text in expected["texts"].items():
        assert tokenizer.encode(text).ids == expected["ids"][key], key


@pytest.mark.parametrize("pre", sorted({p.fused: n for n, p in PRE_TOKENIZERS.items() if p.fused}.values()))
def test_fused_regex_cuts_as_llama_cpp_regexes(pre: str) -> None:
    """A type's one fused regex cuts text exactly as llama.cpp's list run one by one."""
    from tokenizers import Regex, pre_tokenizers

    spec = PRE_TOKENIZERS[pre]

    def pieces(regexes: tuple[str, ...], text: str) -> list[str]:
        split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated")
                                         for r in regexes])
        return [piece for piece, _ in split.pre_tokenize_str(text)]

    samples = [t for c in fixture()["cases"].values() for t in c["texts"].values()]
    samples += [GPL3.read_text(encoding="utf-8"), "a  1 \t 2\n\n  0. x1y 2 z  \n3", " 1", "1 "]
    for text in samples:
        assert pieces(spec.steps, text) == pieces(spec.regexes, text), text[:40]
    assert spec.steps != spec.regexes


@pytest.mark.parametrize(("case", "keys", "bos", "eos"), [
    ("spm-True", {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True},
     False, True),
    ("spm-True", {"tokenizer.ggml.add_bos_token": None, "tokenizer.ggml.add_eos_token": None},
     True, False),  # SentencePiece's default in llama.cpp: BOS
    ("bpe-llama3", {"tokenizer.ggml.add_bos_token": None}, True, False),  # llama3's default
    ("bpe-qwen2", {"tokenizer.ggml.add_bos_token": None}, False, False),
    ("bpe-smollm", {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True},
     True, True),
])
def test_bos_and_eos_follow_the_add_keys(case: str, keys: dict[str, bool | None], bos: bool,
                                         eos: bool, tmp_path: Path,
                                         vocab_files: dict[str, tuple[Path, str]]) -> None:
    """``add_bos_token`` / ``add_eos_token`` as the file says; absent (None), llama.cpp's
    default for the vocabulary and pre type. Only ``add_special_tokens`` adds them."""
    import sys

    from gguf import GGUFValueType

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_models import _tokenizer_fields

    fields = [f for f in _tokenizer_fields(vocab_files[case][0]) if f[0] not in keys]
    fields += [(k, v, (GGUFValueType.BOOL,)) for k, v in keys.items() if v is not None]
    path = write_tokenizer_gguf(fields, tmp_path / "keys.gguf")
    vocab = read_vocab(path, open_header(path))
    tokenizer = build_tokenizer(vocab)
    plain = tokenizer.encode("Hello", add_special_tokens=False).ids
    ids = tokenizer.encode("Hello", add_special_tokens=True).ids
    assert ids == [vocab.special_ids["bos"]] * bos + plain + [vocab.special_ids["eos"]] * eos
