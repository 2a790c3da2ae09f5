"""FreeToken's tokenizer of a GGUF file tokenizes as llama.cpp does (issue #34).

The oracle is tests/fixtures/gguf_tokenizer_ids.json: llama.cpp's ids (``llama-tokenize``,
add_special and parse_special, as llama-server tokenizes a prompt) for the texts of
tests/gguf_tokenizer_cases.py over the default model's vocabulary re-labelled with one
``tokenizer.ggml.pre`` name of each pre-tokenizer FreeToken builds, over two SentencePiece
models, over three Gemma 4 (``gemma4``) BPE vocabularies trained in the test and over those
as ``gpt2`` vocabularies of the SentencePiece-style pre types; and a digest of llama.cpp's
ids for every name llama.cpp knows. The cuts of the pre types the ids cannot tell apart
are held to llama.cpp's pieces of short texts (tests/gguf_pretokenizer_probes.py). Decoding
is checked against llama.cpp's pieces (``llama_vocab::token_to_piece``) computed here, and
streaming against the incremental detokenizer."""

from __future__ import annotations

import dataclasses
import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from gguf_pretokenizer_probes import PROBES
from gguf_tokenizer_cases import (
    FIXTURE,
    GPL3,
    bpe_tokenizer_gguf,
    case_texts,
    ids_digest,
    special_texts,
    vocabularies,
    write_tokenizer_gguf,
)

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_pretokenizers import PRE_TOKENIZERS, PreTokenizer
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


def case_pre(case: str) -> str | None:
    """The pre type of a ``bpe-<pre>`` or ``spmbpe-<pre>-<variant>`` case, else None."""
    if case.startswith("bpe-"):
        return case[4:]
    return case[7:case.rindex("-")] if case.startswith("spmbpe-") else None


def test_fixture_covers_every_pre_tokenizer_and_both_spm_prefixes() -> None:
    covered = {id(PRE_TOKENIZERS[pre]) for pre in map(case_pre, CASES) if pre is not None}
    assert covered == {id(spec) for spec in PRE_TOKENIZERS.values()}
    assert set(fixture()["names"]) == set(PRE_TOKENIZERS)
    assert {"spm-True", "spm-False", "spm-phi3"} <= set(CASES)
    assert {"gemma4-lines", "gemma4-merged", "gemma4-bytes"} <= set(CASES)
    assert all(len(c["ids"]) == len(c["texts"]) >= 13 for c in fixture()["cases"].values())


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
    """The fixture holds no copy-paste: the types differ where their regexes do. Over this
    vocabulary qwen35 (marks in letter runs) and bailingmoe (its spelling of qwen2's regex)
    cut where qwen2 does or into pieces that merge alike, which the probes tell apart."""
    ids = {case: json.dumps(c["ids"]) for case, c in fixture()["cases"].items()}
    assert ids["bpe-llama-bpe"] == ids["bpe-llama3"]
    assert ids["bpe-qwen2"] == ids["bpe-deepseek-r1-qwen"] == ids["bpe-qwen35"]
    assert ids["bpe-qwen2"] == ids["bpe-bailingmoe"]
    assert ids["spmbpe-gemma4-lines"] == ids["gemma4-lines"]
    alike = {"bpe-llama-bpe", "bpe-deepseek-r1-qwen", "bpe-qwen35", "bpe-bailingmoe",
             "bpe-starcoder", "spmbpe-gemma4-lines"}  # starcoder: smollm's type
    distinct = {ids[case] for case in CASES if case not in alike}
    assert len(distinct) == len(CASES) - len(alike)


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
        elif vocab.is_spm or vocab.pre_tokenizer.escape_whitespaces:
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
        body = ids[1:] if vocab.adds()[0] else ids  # less the BOS the file adds
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


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenizer.ggml.pre", "no-such-pre",
     (r"unknown GGUF pre-tokenizer type tokenizer\.ggml\.pre = 'no-such-pre' \(llama\.cpp "
      r"refuses it too.*names llama\.cpp knows.*'gpt2'.*qwen35")),
    ("tokenizer.ggml.pre", "whitespace",
     r"tokenizer\.ggml\.pre = 'whitespace' is not supported: .*embedding"),
    ("tokenizer.ggml.model", "t5", r"tokenizer\.ggml\.model = 't5' is not supported"),
])
def test_unknown_or_refused_types_are_load_errors(key: str, value: str, message: str,
                                                  tmp_path: Path) -> None:
    """llama.cpp refuses a file of an unknown pre type; so does FreeToken, naming the key and
    the value, and it refuses the types it does not build, where llama.cpp would tokenize."""
    path = (bpe_tokenizer_gguf(value, tmp_path) if key == "tokenizer.ggml.pre"
            else bpe_tokenizer_gguf("default", tmp_path, model=value))
    with pytest.raises(ModelLoadError, match=message) as error:
        read_vocab(path, open_header(path))
    assert str(path) in str(error.value)


@pytest.mark.parametrize("pre", ["smollm", "kimi-k2"])
def test_a_gpt2_vocabulary_without_merges_is_refused_but_kimi_k2s(pre: str,
                                                                  tmp_path: Path) -> None:
    """llama.cpp refuses a ``gpt2`` file without ``tokenizer.ggml.merges`` unless its pre
    type is ``kimi-k2``; so does FreeToken, naming the key."""
    from gguf import GGUFValueType as T
    from gguf_tokenizer_cases import _fields_of

    from freetoken_core.models.resolve import default_gguf_path

    fields = [f for f in _fields_of(default_gguf_path())
              if f[0] not in ("tokenizer.ggml.merges", "tokenizer.ggml.pre")]
    path = write_tokenizer_gguf(fields + [("tokenizer.ggml.pre", pre, (T.STRING,))],
                                tmp_path / f"{pre}.gguf")
    if pre == "kimi-k2":
        assert read_vocab(path, open_header(path)).merges == []
    else:
        with pytest.raises(ModelLoadError, match=r"'gpt2' tokenizer without merges \(no "
                           r"tokenizer\.ggml\.merges"):
            read_vocab(path, open_header(path))


def test_a_vocabulary_of_an_unknown_pre_type_builds_no_tokenizer(
        built: dict[str, tuple[GGUFVocab, Any]]) -> None:
    vocab = dataclasses.replace(built["bpe-default"][0], pre="no-such-pre")
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre = 'no-such-pre'"):
        build_tokenizer(vocab)


def test_missing_pre_type_warns_and_splits_as_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As llama.cpp: a file without ``tokenizer.ggml.pre`` gets ``default``, with a warning."""
    path = bpe_tokenizer_gguf(None, tmp_path)
    with caplog.at_level(logging.WARNING, logger="freetoken_core.models.gguf_tokenizer"):
        tokenizer = build_tokenizer(read_vocab(path, open_header(path)))
    assert "no tokenizer.ggml.pre" in caplog.text
    expected = fixture()["cases"]["bpe-default"]
    for key, text in expected["texts"].items():
        assert tokenizer.encode(text).ids == expected["ids"][key], key


def test_every_name_tokenizes_as_llama_cpp(built: dict[str, tuple[GGUFVocab, Any]]) -> None:
    """Each ``tokenizer.ggml.pre`` name llama.cpp knows, over the vocabulary of its type's
    case, gives llama.cpp's ids of every text (their digest: the fixture's ``names``)."""
    bases = {False: built["bpe-default"][0], True: built["spmbpe-sarvam-moe-lines"][0]}
    # a case's tokenizer is its spec's over the same vocabulary (spmbpe: the lines variant)
    tokenizers = {id(vocab.pre_tokenizer): tokenizer for case, (vocab, tokenizer) in built.items()
                  if case.startswith("bpe-") or case.endswith("-lines") and "spmbpe" in case}
    wrong = []
    for pre, expected in fixture()["names"].items():
        vocab = dataclasses.replace(bases[PRE_TOKENIZERS[pre].escape_whitespaces], pre=pre)
        spec = vocab.pre_tokenizer
        texts = case_texts("spmbpe" if spec.escape_whitespaces else "bpe",
                           special_texts(vocab))
        ids = [tokenizers[id(spec)].encode(t, add_special_tokens=True).ids
               for t in texts.values()]
        if ids_digest(ids) != expected:
            wrong.append(pre)
    assert not wrong, f"ids differ from llama.cpp's for {wrong}"


def pieces_of(spec: PreTokenizer, text: str) -> list[str]:
    """The pieces ``spec``'s steps cut ``text`` into."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated")
                                     for r in spec.steps])
    return [piece for piece, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(PROBES))
def test_cuts_are_llama_cpps(pre: str) -> None:
    """The pieces of short texts are llama.cpp's (recorded from ``llama-tokenize``)."""
    for text, pieces in PROBES[pre]:
        assert pieces_of(PRE_TOKENIZERS[pre], text) == pieces, text


@pytest.mark.parametrize("pre", sorted({p.fused: n for n, p in PRE_TOKENIZERS.items() if p.fused}.values()))
def test_fused_regex_cuts_as_llama_cpp_regexes(pre: str) -> None:
    """A type's one fused regex cuts text exactly as llama.cpp's list run one by one."""
    spec = PRE_TOKENIZERS[pre]
    samples = [t for c in fixture()["cases"].values() for t in c["texts"].values()]
    samples += [GPL3.read_text(encoding="utf-8"), "a  1 \t 2\n\n  0. x1y 2 z  \n3", " 1", "1 "]
    for text in samples:
        assert pieces_of(spec, text) == pieces_of(dataclasses.replace(spec, fused=None),
                                                  text), text[:40]
    assert spec.steps != spec.regexes


@pytest.mark.parametrize(("case", "keys", "bos", "eos"), [
    ("spm-True", {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True},
     False, True),
    ("spm-True", {"tokenizer.ggml.add_bos_token": None, "tokenizer.ggml.add_eos_token": None},
     True, False),  # SentencePiece's default in llama.cpp: BOS
    ("bpe-llama3", {"tokenizer.ggml.add_bos_token": None}, True, False),  # llama3's default
    ("bpe-chameleon", {"tokenizer.ggml.add_bos_token": None}, True, False),
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

    extra = tuple((k, v, (GGUFValueType.BOOL,)) for k, v in keys.items() if v is not None)
    if case.startswith("bpe-"):  # written without add_bos_token (no other add_* key)
        path = bpe_tokenizer_gguf(case[4:], tmp_path, extra=extra)
    else:
        fields = [f for f in _tokenizer_fields(vocab_files[case][0]) if f[0] not in keys]
        path = write_tokenizer_gguf(fields + list(extra), tmp_path / "keys.gguf")
    vocab = read_vocab(path, open_header(path))
    tokenizer = build_tokenizer(vocab)
    plain = tokenizer.encode("Hello", add_special_tokens=False).ids
    ids = tokenizer.encode("Hello", add_special_tokens=True).ids
    assert ids == [vocab.special_ids["bos"]] * bos + plain + [vocab.special_ids["eos"]] * eos
