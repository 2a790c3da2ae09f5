"""A small Gemma 4-style vocabulary (``tokenizer.ggml.model = gemma4``) made in the test:
a BPE trained here, deterministically, on a fixed corpus (the GPL-3 text and the code and
prose cases of tests/gguf_tokenizer_cases.py), laid out as llama.cpp's converter writes
Gemma 4 (``conversion/gemma.py``, ``Gemma4Model.set_vocab``): control tokens first, the
chat-parser tokens user-defined, ``<0x00>`` ... ``<0xFF>`` byte tokens, pieces of raw UTF-8
with ``▁`` for spaces, scores -1000, the merges, ``add_space_prefix`` false, ``add_bos``
true and no ``tokenizer.ggml.pre``.

Characters outside Latin (CJK, Cyrillic, emoji ...) get no token, so they fall back to
bytes. Newline tokens, per variant: ``lines`` has ``\\n`` ... ``\\n\\n\\n`` with no merge of
them (as Gemma 4's), ``merged`` has them with the merges ``\\n \\n`` and ``\\n\\n \\n``,
``bytes`` has none (a newline is the byte token ``<0x0A>``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from functools import cache
from itertools import pairwise
from typing import Any

# (text, gguf-py TokenType): 1 normal, 3 control, 4 user-defined. </s> is normal in Gemma 4;
# llama.cpp makes it control (an end-of-generation text), then normal again beside
# <|tool_response>, which the converter makes user-defined and llama.cpp control.
SPECIAL_TOKENS = (
    ("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("</s>", 1),
    ("<|turn>", 3), ("<turn|>", 3), ("<|think|>", 3), ("<|tool>", 3), ("<tool|>", 3),
    ("<|channel>", 4), ("<channel|>", 4), ("<|tool_call>", 4), ("<tool_call|>", 4),
    ("<|tool_response>", 4), ("<tool_response|>", 4), ('<|"|>', 4),
)
BOS, EOS, UNK, PAD = 2, 1, 3, 0
VARIANTS = ("lines", "merged", "bytes")
N_MERGES = 300
_LATIN = re.compile(r"[^\x20-\x7e\xa0-\u024f▁]")  # characters that get no token


def train_merges(lines: list[str], n_merges: int) -> list[tuple[str, str]]:
    """BPE merges learnt from ``lines`` (spaces already ``▁``): each step merges the most
    frequent adjacent pair (ties: the smallest pair), never across a character that gets no
    token. Pure Python, so that the vocabulary depends on nothing but this code."""
    words: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        for chunk in _LATIN.split(line):
            if chunk:
                words[tuple(chunk)] += 1
    merges = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


@cache
def _trained() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The alphabet and the merges, learnt once."""
    from gguf_tokenizer_cases import CAMEL, CODE, GPL3, LISTS, PROSE

    text = GPL3.read_text(encoding="utf-8")[:12000] + CODE + PROSE + LISTS + CAMEL
    lines = [line for line in text.replace(" ", "▁").split("\n") if line]
    alphabet = sorted({c for line in lines for c in _LATIN.sub("", line)})
    return tuple(alphabet), tuple(train_merges(lines, N_MERGES))


def gemma4_vocab(variant: str) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges (``"a b"``) of ``variant`` (:data:`VARIANTS`)."""
    alphabet, merges = _trained()
    tokens = [t for t, _ in SPECIAL_TOKENS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in SPECIAL_TOKENS] + [6] * 256
    newline = [] if variant == "bytes" else ["\n", "\n\n", "\n\n\n"]
    pieces = newline + list(alphabet) + [a + b for a, b in merges]
    tokens += pieces
    types += [1] * len(pieces)
    merge_texts = [f"{a} {b}" for a, b in merges]
    if variant == "merged":
        merge_texts += ["\n \n", "\n\n \n"]
    return tokens, types, merge_texts


def gemma4_fields(variant: str, add_bos: bool | None = True) -> tuple[list[tuple], str]:
    """The ``tokenizer.*`` fields (``(key, value, kinds)``) of ``variant`` as the converter
    writes them (``add_bos`` None: no ``add_bos_token`` key) and the sha256 of its tokens,
    types and merges (training must give the fixture's vocabulary)."""
    from gguf import GGUFValueType as T

    tokens, types, merges = gemma4_vocab(variant)
    fields: list[tuple[str, Any, tuple]] = [
        ("tokenizer.ggml.model", "gemma4", (T.STRING,)),
        ("tokenizer.ggml.tokens", tokens, (T.ARRAY, T.STRING)),
        ("tokenizer.ggml.scores", [-1000.0] * len(tokens), (T.ARRAY, T.FLOAT32)),
        ("tokenizer.ggml.token_type", types, (T.ARRAY, T.INT32)),
        ("tokenizer.ggml.merges", merges, (T.ARRAY, T.STRING)),
        ("tokenizer.ggml.bos_token_id", BOS, (T.UINT32,)),
        ("tokenizer.ggml.eos_token_id", EOS, (T.UINT32,)),
        ("tokenizer.ggml.unknown_token_id", UNK, (T.UINT32,)),
        ("tokenizer.ggml.padding_token_id", PAD, (T.UINT32,)),
        ("tokenizer.ggml.add_space_prefix", False, (T.BOOL,)),
    ]
    if add_bos is not None:
        fields.append(("tokenizer.ggml.add_bos_token", add_bos, (T.BOOL,)))
    digest = hashlib.sha256(json.dumps([tokens, types, merges]).encode()).hexdigest()
    return fields, digest
