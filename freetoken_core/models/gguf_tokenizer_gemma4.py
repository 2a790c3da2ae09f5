"""Gemma 4's GGUF tokenizer (``tokenizer.ggml.model = gemma4``) as llama.cpp runs it.

llama.cpp (``src/llama-vocab.cpp``) loads a ``gemma4`` vocabulary as a BPE over the file's
merges (each ``"first second"`` cut at its first space after the first character; the file's
``tokenizer.ggml.pre`` is ignored: the pre type is always ``gemma4``) and tokenizes it as a
SentencePiece-style BPE:

* spaces are written ``▁`` (``escape_whitespaces``) in each run of text between special
  tokens, and no ``▁`` is prefixed (``add_space_prefix`` is false for BPE);
* the only split is the regex ``[^\\n]+|[\\n]+``: a line and a run of newlines are words,
  merged without the GPT-2 byte alphabet (``byte_encode = false``: raw UTF-8);
* a word made only of newlines that is itself a token is taken whole, without merging
  (ggml-org/llama.cpp#21343: Gemma 4's newline tokens have no merges); any other word is
  merged, lowest merge rank first (``ignore_merges`` is false);
* a piece that is no token falls back to its bytes' ``<0xNN>`` tokens;
* BOS is always added: a file whose ``add_bos_token`` is false is overridden (a warning);
* a piece of a normal token is its text with ``▁`` as a space, a byte token's is its byte.

The ``tokenizers`` pipeline: normalizer ``Replace(" ", "▁")``, a ``Split`` on
``[^\\n]+|[\\n]+``, BPE with ``byte_fallback`` and the decoder ``▁`` -> space, ``<0xNN>`` ->
byte. ``tokenizers`` has no "take a newline run whole when it is a token" rule, so it is built
from merges, which only ever meet newline-only words (every word is a line or a run of
newlines): a merge of every two newline tokens into a third (after the file's merges, so
that a newline token is always built whole). Where the file has no merge of newlines (Gemma 4)
llama.cpp leaves a run that is no token as single newlines, which a second ``Split`` does:
a run whose length is a token's is one word, any other is cut into single newlines. Where the
file does merge newlines, a run that is no token is merged as its merges say, as there, but
with the added merges too: where the file's merges do not build every newline token (not
Gemma 4's layout), such a run can merge further than in llama.cpp (tokens of 1 to 4
newlines, merges of 1+1 and 2+1 only: runs of 6 and more differ).

A ``gpt2`` vocabulary whose ``tokenizer.ggml.pre`` llama.cpp maps to its Gemma 4 type
(``gemma4``, ``granite-embed-multi-311m``) is built the same way; ``sarvam-moe``'s type is
the same but for the newline rule and BOS: its newline runs are merged as any word (no
merges added, no second ``Split``) and ``add_bos_token`` is the file's.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["build_gemma4_tokenizer"]

log = logging.getLogger(__name__)

_SPLIT = r"[^\n]+|[\n]+"


def build_gemma4_tokenizer(vocab: Any) -> Any:
    """The ``tokenizers.Tokenizer`` model, normalizer, pre-tokenizer and decoder that
    tokenize a ``gemma4`` ``GGUFVocab``, or a ``gpt2`` one of a SentencePiece-style pre type,
    as llama.cpp does (see the module docstring); special tokens and BOS / EOS are the
    caller's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from freetoken_core.models.gguf_tokenizer import bpe_merges

    ids = {text: i for i, text in enumerate(vocab.tokens)}  # a repeated text: its last id
    merges = bpe_merges(vocab.merges, ids)
    seen = set(merges)
    gemma4 = vocab.pre_tokenizer.gemma4
    lengths = sorted(len(t) for t in ids if t and not t.strip("\n")) if gemma4 else []
    newline_merges = any(not (a + b).strip("\n") for a, b in merges)
    for total in lengths:
        for left in range(1, total):
            pair = ("\n" * left, "\n" * (total - left))
            if left in lengths and total - left in lengths and pair not in seen:
                seen.add(pair)
                merges.append(pair)
    tokenizer = Tokenizer(models.BPE(ids, merges, byte_fallback=True, ignore_merges=False))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    steps = [pre_tokenizers.Split(Regex(_SPLIT), "isolated")]
    if not newline_merges and any(n > 1 for n in lengths):
        whole = "|".join(f"\\n{{{n}}}" for n in reversed(lengths))
        steps.append(pre_tokenizers.Split(Regex(f"(?<!\\n)(?:{whole})(?!\\n)|\\n"), "isolated"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    if gemma4 and vocab.add_bos is False:
        log.warning("this Gemma 4 GGUF says tokenizer.ggml.add_bos_token = false; adding BOS "
                    "anyway, as llama.cpp overrides it to true for Gemma 4")
    return tokenizer
