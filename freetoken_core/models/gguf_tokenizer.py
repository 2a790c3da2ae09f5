"""A GGUF file's tokenizer, built from its ``tokenizer.*`` metadata to tokenize as llama.cpp.

llama.cpp implements each ``tokenizer.ggml.pre`` type so that it reproduces the tokenizer
the model was trained with (``src/llama-vocab.cpp``); its ids are the reference here, not
transformers' GGUF conversion (which, for one, drops SmolLM2's digit split). The result is
a Hugging Face ``tokenizers.Tokenizer`` (the Rust library: no tokenization loop in Python),
saved as ``tokenizer.json`` beside a ``tokenizer_config.json`` that transformers'
generic fast tokenizer loads. How each part of llama.cpp maps onto it:

* **Vocabulary** ``tokenizer.ggml.model = gpt2``: byte-level BPE with the file's merges, the
  text cut by the regexes of its pre type (:mod:`gguf_pretokenizers`, every name llama.cpp
  knows; a missing type warns and uses ``default``, as llama.cpp does, and an unknown one
  is refused, as there) and byte-encoded; the SentencePiece-style pre types (``gemma4``,
  ``sarvam-moe`` ...) are built as ``gemma4`` vocabularies are.
  ``llama``: SentencePiece, a BPE whose merge order is the merged piece's score (llama.cpp
  merges the best-scoring bigram first), byte fallback, spaces written ``▁`` and, when
  ``tokenizer.ggml.add_space_prefix`` (default true) says so, a ``▁`` prefixed to every run
  of text: llama.cpp prefixes it to the first one and to each one after a special token,
  and every run of text but the first follows one.
  ``gemma4`` (Gemma 4): a BPE over the file's merges on raw UTF-8 with ``▁`` for spaces and
  no prefix, split only into lines and runs of newlines (a run that is a token taken
  whole), byte fallback, BOS always (:mod:`gguf_tokenizer_gemma4`).
* **Special tokens** (``parse_special``): control (3), unknown (2) and user-defined (4)
  tokens are cut out of the text before anything else, matched on their raw text; the
  first two are special (dropped by ``skip_special_tokens``, as llama.cpp renders them only
  with ``special``). The types are llama.cpp's after it loads the file: a token whose text
  it ends generation on (:data:`EOG_TEXTS`) is control, but ``</s>`` beside
  ``<|tool_response>`` (Gemma 4) or ``<|plamo:eos|>``, which is normal, and gpt-oss's
  ``<|end|>``, ``<|channel|>`` ..., which are user-defined (:func:`llama_cpp_types`). In a
  file named Phi-3 they swallow the whitespace after them (but ``<unk>``, ``<s>``,
  ``<|endoftext|>``), as llama.cpp sets there.
* **BOS / EOS**: added by ``add_special_tokens`` as ``tokenizer.ggml.add_bos_token`` /
  ``add_eos_token`` say, else as llama.cpp's defaults for the vocabulary and pre type
  (Gemma 4: BOS whatever the file says).
* **Decoding** is the concatenation of llama.cpp's pieces (byte-level pieces back to their
  bytes, ``▁`` to a space (SentencePiece, Gemma 4), ``<0xNN>`` to its byte, special
  tokens as their text), less the one space a SentencePiece prefix added at the start, so
  that decode inverts encode.
  Not replayed: ``tokenizers`` runs added tokens through the vocabulary's decoder too, so a
  byte-level vocabulary's user-defined token spelled wholly in GPT-2's byte alphabet with
  non-ASCII letters ("café") decodes as those bytes (converters write none: ``<think>``,
  ``<|im_end|>``), and a SentencePiece control token holding ``▁`` (CodeLlama's
  ``▁<PRE>``), shown by ``skip_special_tokens=False``, has a space there; llama.cpp prints
  both as written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_pretokenizers import (
    DEFAULT,
    PRE_TOKENIZERS,
    PreTokenizer,
    unsupported_pre,
)

__all__ = ["EOG_TEXTS", "GGUFVocab", "build_tokenizer", "llama_cpp_types", "read_vocab",
           "tokenizer_config"]

log = logging.getLogger(__name__)

# gguf-py's TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
           "tokenizer.ggml.merges")
_SPECIAL_IDS = ("bos", "eos", "unknown", "padding")
_MODELS = ("gpt2", "llama", "gemma4")

EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
"""The texts of the tokens llama.cpp ends generation on whatever the metadata says
(``special_eog_ids`` in src/llama-vocab.cpp), and makes control tokens."""


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.*`` metadata of a GGUF file that its tokenizer is built from.

    ``types`` holds one gguf-py ``TokenType`` per token (all normal when the file has none
    for each token), ``scores`` one score per token (empty when the file has none for each
    token), ``merges`` the ``"a b"`` strings;
    ``special_ids`` maps ``bos`` / ``eos`` / ``unknown`` / ``padding`` to the ids the file
    names that lie in the vocabulary; ``add_*`` are None where the file has no such key."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    special_ids: dict[str, int]
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    name: str = ""

    @cached_property
    def pre_tokenizer(self) -> PreTokenizer:
        """The pre type's :class:`PreTokenizer` (a ``gemma4`` vocabulary's is ``gemma4``,
        whatever the file says, a SentencePiece one's ``default``); a missing type is logged
        (once) as a warning and gets llama.cpp's ``default``; a type FreeToken does not build
        raises :class:`ModelLoadError` naming it."""
        if self.model == "gemma4":
            return PRE_TOKENIZERS["gemma4"]
        if self.is_spm:
            return DEFAULT
        if self.pre is None:
            log.warning("this GGUF has no tokenizer.ggml.pre; splitting its text with "
                        "llama.cpp's 'default' pre-tokenizer")
            return DEFAULT
        reason = unsupported_pre(self.pre)
        if reason is not None:
            raise ModelLoadError(reason)
        return PRE_TOKENIZERS[self.pre]

    @property
    def is_spm(self) -> bool:
        return self.model == "llama"

    def token(self, kind: str) -> str | None:
        """The text of special token ``kind`` (``bos`` ...), or None."""
        token_id = self.special_ids.get(kind)
        return None if token_id is None else self.tokens[token_id]

    def adds(self) -> tuple[bool, bool]:
        """Whether encode adds BOS and EOS: the file's keys, else llama.cpp's defaults
        (SentencePiece: BOS; BPE: BOS for the pre types that set it), and never a token
        the file does not name."""
        add_bos = self.add_bos
        if self.pre_tokenizer.gemma4:
            add_bos = True  # llama.cpp overrides a false add_bos_token for Gemma 4
        elif add_bos is None:
            add_bos = self.is_spm or self.pre_tokenizer.add_bos
        add_eos = bool(self.add_eos)
        return (add_bos and "bos" in self.special_ids, add_eos and "eos" in self.special_ids)


def read_vocab(gguf_path: Path, reader: Any) -> GGUFVocab:
    """The vocabulary of ``gguf_path``, whose scalar metadata ``reader`` holds (from
    ``open_header``). Raises :class:`ModelLoadError` for a file without tokens or with a
    tokenizer model other than ``gpt2``, ``llama`` and ``gemma4``, a ``gemma4`` one without
    merges, a ``gpt2`` one without merges but for Kimi-K2's (llama.cpp refuses all three) or
    a ``gpt2`` one whose ``tokenizer.ggml.pre`` is not built (:func:`unsupported_pre`:
    llama.cpp refuses an unknown one)."""
    from freetoken_core.models.gguf_reader import field, read_arrays

    arrays = read_arrays(gguf_path, _ARRAYS)
    model = field(reader, "tokenizer.ggml.model")
    tokens = arrays.get("tokenizer.ggml.tokens", [])
    if not tokens:
        raise ModelLoadError(f"{gguf_path} has no tokenizer (no tokenizer.ggml.tokens)")
    if model not in _MODELS:
        raise ModelLoadError(
            f"{gguf_path}: GGUF tokenizer model tokenizer.ggml.model = {model!r} is not "
            "supported (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece and 'gemma4' "
            "Gemma 4 BPE; not llama.cpp's 'bert', 't5', 'rwkv', 'plamo2', 'hybriddna', "
            "'whitespace' ...)")
    pre = field(reader, "tokenizer.ggml.pre")
    reason = None if model != "gpt2" or pre is None else unsupported_pre(pre)
    if reason is not None:
        raise ModelLoadError(f"{gguf_path}: {reason}")
    if model == "gemma4" and not arrays.get("tokenizer.ggml.merges"):
        raise ModelLoadError(f"{gguf_path} has a 'gemma4' tokenizer without merges "
                             "(no tokenizer.ggml.merges)")
    if model == "gpt2" and "tokenizer.ggml.merges" not in arrays and pre != "kimi-k2":
        # (llama.cpp's rule: only Kimi-K2's files may leave the merges out)
        raise ModelLoadError(f"{gguf_path} has a 'gpt2' tokenizer without merges (no "
                             "tokenizer.ggml.merges; only tokenizer.ggml.pre 'kimi-k2' "
                             "may have none)")
    types = [int(t) for t in arrays.get("tokenizer.ggml.token_type", [])]
    scores = [float(s) for s in arrays.get("tokenizer.ggml.scores", [])]
    special_ids = {}
    for kind in _SPECIAL_IDS:
        token_id = field(reader, f"tokenizer.ggml.{kind}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special_ids[kind] = int(token_id)
    return GGUFVocab(
        model=model, pre=pre, tokens=list(tokens),
        types=types if len(types) == len(tokens) else [NORMAL] * len(tokens),
        scores=scores if len(scores) == len(tokens) else [],
        merges=list(arrays.get("tokenizer.ggml.merges", [])), special_ids=special_ids,
        add_bos=_flag(field(reader, "tokenizer.ggml.add_bos_token")),
        add_eos=_flag(field(reader, "tokenizer.ggml.add_eos_token")),
        add_space_prefix=_flag(field(reader, "tokenizer.ggml.add_space_prefix")),
        name=str(field(reader, "general.name", "")).lower())


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def build_tokenizer(vocab: GGUFVocab) -> Any:
    """The ``tokenizers.Tokenizer`` that tokenizes and decodes as llama.cpp does with
    ``vocab`` (see the module docstring)."""
    from tokenizers import Tokenizer

    if vocab.model == "gemma4" or vocab.pre_tokenizer.escape_whitespaces:
        from freetoken_core.models.gguf_tokenizer_gemma4 import build_gemma4_tokenizer

        tokenizer = build_gemma4_tokenizer(vocab)
        _add_special_tokens(tokenizer, vocab)
        _set_post_processor(tokenizer, vocab)
        return tokenizer
    tokenizer = Tokenizer(_spm_model(vocab) if vocab.is_spm else _bpe_model(vocab))
    if vocab.is_spm:
        _set_spm_steps(tokenizer, vocab)
    else:
        _set_bpe_steps(tokenizer, vocab.pre_tokenizer)
    _add_special_tokens(tokenizer, vocab)
    _set_post_processor(tokenizer, vocab)
    return tokenizer


def _token_ids(vocab: GGUFVocab) -> dict[str, int]:
    """Text -> id; where two tokens share a text the later one wins, as in llama.cpp."""
    return {text: i for i, text in enumerate(vocab.tokens)}


def _bpe_model(vocab: GGUFVocab) -> Any:
    """Byte-level BPE over the file's merges, by rank (the first of a repeated merge counts,
    as in llama.cpp); merges of texts outside the vocabulary are dropped (no token)."""
    from tokenizers import models

    ids = _token_ids(vocab)
    return models.BPE(ids, bpe_merges(vocab.merges, ids),
                      ignore_merges=vocab.pre_tokenizer.ignore_merges)


def bpe_merges(texts: list[str], ids: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges (``"first second"``, split at the first space after the first
    character, as llama.cpp splits them) in rank order, each once (the first of a repeated
    merge counts); merges of texts outside the vocabulary ``ids`` are dropped (no token)."""
    merges, seen = [], set()
    for merge in texts:
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1:])
        if cut > 0 and pair not in seen and pair[0] in ids and pair[1] in ids \
                and pair[0] + pair[1] in ids:
            seen.add(pair)
            merges.append(pair)
    return merges


def _set_bpe_steps(tokenizer: Any, pre: PreTokenizer) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(regex), "isolated") for regex in pre.steps]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()


def _spm_model(vocab: GGUFVocab) -> Any:
    """SentencePiece as a BPE: every split of a token into two tokens is a merge, ranked by
    the merged token's score, best first (ties: the lower id first), which is the order in
    which llama.cpp's ``llm_tokenizer_spm`` merges bigrams; characters outside the
    vocabulary fall back to their ``<0xNN>`` byte tokens."""
    from tokenizers import models

    ids = _token_ids(vocab)
    scores = vocab.scores or [0.0] * len(vocab.tokens)
    ranked = []
    for text, token_id in ids.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = vocab.token("unknown")
    return models.BPE(ids, merges, unk_token=unk, fuse_unk=unk is not None, byte_fallback=True)


def _set_spm_steps(tokenizer: Any, vocab: GGUFVocab) -> None:
    from tokenizers import decoders, normalizers

    prefix = vocab.add_space_prefix is not False  # llama.cpp's default for SPM: true
    escape = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), escape])
                            if prefix else escape)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)


def _add_special_tokens(tokenizer: Any, vocab: GGUFVocab) -> None:
    """Control, unknown and user-defined tokens, cut out of the text on their raw text."""
    from tokenizers import AddedToken

    is_phi3 = "phi-3" in vocab.name or "phi3" in vocab.name
    special, user = [], []
    for text, kind in zip(vocab.tokens, llama_cpp_types(vocab)):
        if not text or kind not in (CONTROL, UNKNOWN, USER_DEFINED):
            continue
        rstrip = is_phi3 and text not in ("<unk>", "<s>", "<|endoftext|>")
        token = AddedToken(text, special=kind != USER_DEFINED, normalized=False,
                           rstrip=rstrip)
        (user if kind == USER_DEFINED else special).append(token)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def llama_cpp_types(vocab: GGUFVocab) -> list[int]:
    """The token types as llama.cpp holds them once it has loaded the file
    (``llama_vocab::impl::load``): a token whose text is in :data:`EOG_TEXTS` is control
    (a user-defined one too: llama.cpp then renders it only with ``special``), except
    ``</s>`` beside ``<|tool_response>`` or ``<|plamo:eos|>`` (normal) and ``<|end|>`` beside
    ``<|call|>`` or ``<|calls|>`` and ``<|return|>`` or ``<|flush|>`` (user-defined);
    gpt-oss's ``<|channel|>``, ``<|message|>``, ``<|start|>``, ``<|constrain|>`` are
    user-defined."""
    types = list(vocab.types)
    index = _token_ids(vocab)
    for text in EOG_TEXTS & index.keys():
        types[index[text]] = CONTROL
    if "</s>" in index and index.keys() & {"<|tool_response>", "<|plamo:eos|>"}:
        types[index["</s>"]] = NORMAL
    calls = index.keys() & {"<|call|>", "<|calls|>"}
    if "<|end|>" in index and calls and index.keys() & {"<|return|>", "<|flush|>"}:
        types[index["<|end|>"]] = USER_DEFINED
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if text in index:
            types[index[text]] = USER_DEFINED
    return types


def _set_post_processor(tokenizer: Any, vocab: GGUFVocab) -> None:
    from tokenizers import processors

    add_bos, add_eos = vocab.adds()
    if not (add_bos or add_eos):
        return
    ends = [(vocab.token(k), vocab.special_ids[k]) for k, on in (("bos", add_bos),
                                                                 ("eos", add_eos)) if on]
    first = [ends[0][0]] if add_bos else []
    last = [ends[-1][0]] if add_eos else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*first, "$A", *last], pair=[*first, "$A", *last, *first, "$B", *last],
        special_tokens=list(dict.fromkeys(ends)))


def tokenizer_config(vocab: GGUFVocab, chat_template: str | None,
                     model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` for transformers' generic fast tokenizer
    (``PreTrainedTokenizerFast``) over the ``tokenizer.json`` of :func:`build_tokenizer`:
    the named special tokens, no clean-up of spaces (decode is llama.cpp's pieces), the
    chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for kind, key in zip(_SPECIAL_IDS, ("bos_token", "eos_token", "unk_token", "pad_token")):
        text = vocab.token(kind)
        if text:
            config[key] = text
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
