"""The SentencePiece (``tokenizer.ggml.model = llama``) path on a real SPM model.

The test trains a small SentencePiece BPE model as Llama 2's are trained (byte fallback,
split digits; tests/gguf_spm.py), writes its vocabulary, scores and token types into a
random-weight llama GGUF the way llama.cpp's converter does, and checks FreeToken's
tokenizer of that file (built from the GGUF, ``freetoken_core/models/gguf_tokenizer.py``)
on a few KB of mixed text against the SentencePiece model itself, which llama.cpp's SPM
tokenizer reproduces (same pieces by score, the dummy prefix always added, byte fallback),
and against llama.cpp's rule for special tokens written as text (``llama_cpp_spm``).
tests/test_gguf_tokenizer.py compares the same trained models with llama.cpp's own ids."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q8_0, write_gguf
from gguf_spm import BYTE, CONTROL, NORMAL, UNKNOWN, train_spm, write_spm_tokenizer_gguf

from freetoken_core import LLM, SamplingParams
from freetoken_core.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer

BOS, EOS, UNK = 1, 2, 0
SPECIALS = ("<s>", "</s>", "<unk>")

CJK_EMOJI = ("東京は日本の首都です。我们正在测试分词器，这是第二句。한국어 문장입니다. "
             "Emoji: 😀🎉 👍🏽 🇯🇵 👨‍👩‍👧 🚀 — café, naïve, Ünïcödé ½ ™")


def long_text() -> str:
    """About 4 KB: prose, indented code with blank indented lines, a numbered list, digit
    runs, CJK, emoji, whitespace runs and tabs, and the special tokens written as text. It
    starts with a letter (for text that starts with a space see
    test_text_starting_with_a_space_equals_sentencepiece)."""
    parts = [
        ("Tokenizers split text into pieces. This paragraph is plain English prose, with "
         "commas, semicolons; quotes \"like these\" and 'these', parentheses (and brackets "
         "[x]) and a hyphenated-word or two.\n\n"),
        ("def fibonacci(n: int) -> int:\n    \"\"\"The n-th number.\"\"\"\n    a, b = 0, 1\n"
         "    for _ in range(n):\n        a, b = b, a + b\n    \n        \n    return a\n\n"
         "\tif x:\n\t\treturn {\"key\": [1, 2, 3]}\n"),
        "1. First item\n2. Second item\n   - nested bullet\n10. Tenth item\n\n",
        ("Digits: 0 12 345 6789 3.14159265358979 1,000,000 2024-06-30 0xDEADBEEF 1e-9 "
         "00000000000000000000 99999999\n"),
        CJK_EMOJI + "\u00a0nbsp\n",
        "Whitespace:   three spaces,\t tab, trailing spaces   \n   \n\n\n   four newlines\n",
        "Specials as text: <s> and </s> and <unk> inside a sentence, <s>glued</s>to words.\n",
    ]
    text = "".join(parts)
    return (text * (4000 // len(text) + 1))[:4000]


def without_specials(text: str) -> str:
    for special in SPECIALS:
        text = text.replace(special, "")
    return text


def llama_cpp_spm(sp: Any, text: str) -> list[int]:
    """llama.cpp's ``llama_tokenize_impl`` for an SPM vocabulary, with ``add_special`` and
    ``parse_special``: BOS, then the text cut at the control/unknown tokens' texts, each
    piece of text SentencePiece-encoded with a space prefixed (its dummy prefix: llama.cpp
    prefixes one to the first fragment and to every fragment after a special token)."""
    ids = [BOS]
    for fragment in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        if fragment in SPECIALS:
            ids.append(sp.piece_to_id(fragment))
        elif fragment:
            ids.extend(sp.encode(fragment))
    return ids


def first_difference(tokenizer: Any, ours: list[int], theirs: list[int]) -> str:
    """Where two id lists part, with the pieces around it, for an assertion message."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
             min(len(ours), len(theirs)))
    window = slice(max(i - 3, 0), i + 4)
    return (f"lengths {len(ours)} vs {len(theirs)}, first difference at {i}: "
            f"{tokenizer.convert_ids_to_tokens(ours[window])} {ours[window]} vs "
            f"{tokenizer.convert_ids_to_tokens(theirs[window])} {theirs[window]}")


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trained SentencePiece model and the llama GGUF with its vocabulary. (The GGUF is
    in a directory of its own: transformers would read a tokenizer.model next to it.)"""
    import sentencepiece

    root = tmp_path_factory.mktemp("gguf-spm")
    model = train_spm(root / "spm")
    tokenizer_gguf = write_spm_tokenizer_gguf(model, root / "spm" / "tokenizer.gguf")
    (root / "gguf").mkdir()
    path = write_gguf(root / "gguf" / "tiny-llama-spm.gguf", "llama", hidden=64, ff=128,
                      weight_type=Q8_0, tokenizer_from=tokenizer_gguf, seed=3)
    return {"root": root, "model": model, "gguf": path,
            "sp": sentencepiece.SentencePieceProcessor(model_file=str(model))}


@pytest.fixture(scope="module")
def llm(spm_files: dict[str, Any]) -> LLM:
    return LLM(str(spm_files["gguf"]), progress=False, plugins="none", kv_cache_tokens=2048,
               dtype="float32")


def test_gguf_holds_the_spm_vocabulary_as_llama_cpp_writes_it(spm_files: dict[str, Any],
                                                               llm: LLM) -> None:
    from gguf import GGUFReader

    sp = spm_files["sp"]
    fields = GGUFReader(spm_files["gguf"]).fields
    types = [fields["tokenizer.ggml.token_type"].parts[i].tolist()[0]
             for i in fields["tokenizer.ggml.token_type"].data]
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in fields["tokenizer.ggml.tokens"].data]
    assert len(tokens) == sp.vocab_size() == 1000
    assert types[:3] == [UNKNOWN, CONTROL, CONTROL] and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {BYTE} and set(types[259:]) == {NORMAL}
    assert "▁▁▁▁" in tokens and any(re.fullmatch(r"[\u3040-\u9fff]", t) for t in tokens)
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    # What FreeToken serves from it: BOS added, the GGUF's chat template and special tokens.
    tok = llm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (BOS, EOS, UNK)
    assert apply_chat_template(tok, [{"role": "user", "content": "Hi"}]) == "<s>[INST] Hi [/INST]"


def test_encode_equals_llama_cpp_rule(llm: LLM, spm_files: dict[str, Any]) -> None:
    for text in (long_text(), CJK_EMOJI, " leading", "\n\n  0.", "a<s>b</s> <unk>", ""):
        ours, theirs = llm.tokenizer.encode(text), llama_cpp_spm(spm_files["sp"], text)
        assert ours == theirs, (text[:40], first_difference(llm.tokenizer, ours, theirs))


def test_encode_equals_sentencepiece(llm: LLM, spm_files: dict[str, Any]) -> None:
    text = without_specials(long_text())
    ours = llm.tokenizer.encode(text)
    theirs = [BOS] + spm_files["sp"].encode(text)
    assert ours == theirs, first_difference(llm.tokenizer, ours, theirs)
    assert len(ours) > 3000
    assert sum(3 <= i < 259 for i in ours) > 100  # byte fallback (CJK, emoji, newlines)


def test_special_tokens_written_as_text_are_parsed(llm: LLM) -> None:
    # as llama.cpp's tokenizer with parse_special (llama-server's /tokenize, prompts)
    ids = llm.tokenizer.encode("x<s>y</s>z<unk>")
    assert ids.count(BOS) == 2 and ids.count(EOS) == 1 and ids.count(UNK) == 1


def test_text_starting_with_a_space_equals_sentencepiece(llm: LLM,
                                                         spm_files: dict[str, Any]) -> None:
    for text in (" Hello", "  two spaces", " " + long_text()[:200]):
        ours = llm.tokenizer.encode(text)
        theirs = [BOS] + spm_files["sp"].encode(text)
        assert ours == theirs, (text[:20], first_difference(llm.tokenizer, ours, theirs))
        assert llm.tokenizer.decode(ours, skip_special_tokens=True) == text


def test_special_tokens_as_text_equal_llama_cpp(llm: LLM, spm_files: dict[str, Any]) -> None:
    text = long_text()
    ours, theirs = llm.tokenizer.encode(text), llama_cpp_spm(spm_files["sp"], text)
    assert ours == theirs, first_difference(llm.tokenizer, ours, theirs)


def test_decode_round_trips(llm: LLM) -> None:
    """Decode inverts encode, but for the space llama.cpp prefixes to the text after each
    special token written as text (it decodes as one, in llama.cpp too)."""
    tok = llm.tokenizer
    text = long_text()
    ids = tok.encode(text)
    pieces = re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text)
    spaced = "".join(" " + p if p and i > 0 and pieces[i - 1] in SPECIALS else p
                     for i, p in enumerate(pieces))
    assert spaced != text
    assert tok.decode(ids[1:], skip_special_tokens=False) == spaced
    plain = without_specials(text)
    assert tok.decode(tok.encode(plain), skip_special_tokens=True) == plain


def test_streaming_decode_never_splits_a_character(llm: LLM) -> None:
    text = CJK_EMOJI * 3
    ids = llm.tokenizer.encode(text)
    assert sum(3 <= i < 259 for i in ids) > 20  # characters spelled as UTF-8 bytes
    detok = IncrementalDetokenizer(llm.tokenizer, ids[:1])
    deltas = [detok.add([i]) for i in ids[1:]]
    deltas.append(detok.finish())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas.count("") > 10  # it waited for the rest of a character's bytes


def test_greedy_matches_transformers(llm: LLM, spm_files: dict[str, Any]) -> None:
    from gguf_reference import hf_from_gguf

    prompts = [llm.tokenizer.encode(p) for p in
               ("The tokenizer learns", "def add(a, b):\n    return", CJK_EMOJI, "1. 2. 3.")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    hf = hf_from_gguf(spm_files["gguf"])
    distinct = set()
    for ids, out in zip(prompts, outs):
        prompt = torch.tensor([ids])
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                          min_new_tokens=8, do_sample=False, pad_token_id=EOS)
        ref = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, ids
        distinct |= set(ref)
    assert len(distinct) > 4


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_add_space_prefix_key(add_space_prefix: bool, tmp_path: Path) -> None:
    """The key written (llama's converter omits it; Gemma's writes false), with a
    SentencePiece model trained with the matching dummy prefix: FreeToken's tokenizer of
    the file (the one LLM loads) equals that model's ids."""
    import sentencepiece

    from freetoken_core.models.resolve import resolve_model

    model = train_spm(tmp_path / "spm", add_dummy_prefix=add_space_prefix)
    tokenizer_gguf = write_spm_tokenizer_gguf(model, tmp_path / "spm" / "tokenizer.gguf",
                                              add_space_prefix=add_space_prefix)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(tmp_path / "gguf" / f"spm-prefix-{add_space_prefix}.gguf", "llama",
                      tokenizer_from=tokenizer_gguf)
    tok = load_tokenizer(resolve_model(path, progress=False))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    for text in ("Hello", without_specials(long_text())):
        ours, theirs = tok.encode(text), [BOS] + sp.encode(text)
        assert ours == theirs, first_difference(tok, ours, theirs)


def test_completions_add_the_files_bos(spm_files: dict[str, Any], llm: LLM) -> None:
    """/v1/completions adds the special tokens the file asks for (``add_bos_token`` true
    here) to a text prompt, as vLLM and llama-server do; ``add_special_tokens: false`` takes
    the text alone, and token ids are taken as they are."""
    from server_fixtures import ok, start_server, stop_server

    text = "The tokenizer learns"
    bare = llm.tokenizer.encode(text, add_special_tokens=False)
    bos = llm.tokenizer.bos_token_id
    assert bos is not None and bare[0] != bos
    srv = start_server(spm_files["gguf"], "--kv-cache-tokens", "2048", "--plugins", "none")
    try:
        def prompt_tokens(body: dict[str, Any]) -> int:
            body = {"max_tokens": 1, "temperature": 0, **body}
            return ok(srv, "/v1/completions", body)["usage"]["prompt_tokens"]

        assert prompt_tokens({"prompt": text}) == len(bare) + 1
        assert prompt_tokens({"prompt": text, "add_special_tokens": False}) == len(bare)
        assert prompt_tokens({"prompt": bare}) == len(bare)
        # the first prompt token is the BOS: echo with logprobs lists the prompt's tokens
        body = {"prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0,
                "temperature": 0}
        first = ok(srv, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"][0]
        assert first == llm.tokenizer.convert_ids_to_tokens(bos)
    finally:
        stop_server(srv)
