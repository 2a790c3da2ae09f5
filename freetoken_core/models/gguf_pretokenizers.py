"""The pre-tokenizer of each GGUF ``tokenizer.ggml.pre`` type, as llama.cpp runs it.

llama.cpp (``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``) splits the text of a byte-level
BPE vocabulary (``tokenizer.ggml.model = gpt2``) with a list of regexes applied one after
the other: each regex cuts every piece left by the previous ones into its matches and the
text between them (``unicode_regex_split``), and only then are the pieces byte-encoded and
merged. :data:`PRE_TOKENIZERS` holds those lists, copied from llama.cpp (its "adapted"
forms where it adapts the original tokenizer.json regex: the ``(?i:...)`` contractions
spelled out, and tekken / gpt-4o's letter classes written as the look-aheads llama.cpp
matches against its collapsed text, where every non-ASCII letter is both upper and lower
case). Each list is replayed by ``tokenizers``' ``Split(..., "isolated")`` steps, which
have the same semantics.

A type llama.cpp gives ``ignore_merges`` (a word that is itself a token is taken whole)
or ``add_bos`` by default says so in its :class:`PreTokenizer`; the file's
``tokenizer.ggml.add_bos_token`` overrides the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT", "PRE_TOKENIZERS", "PreTokenizer"]

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's stand-ins for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes in order, and the defaults it sets.

    ``fused``, where set, is one regex that cuts text exactly as ``regexes`` one after the
    other do, and is what runs (one pass over the text instead of several: the default
    file's tokenizer is then as fast as transformers' conversion); tests check that the
    two cut every test text alike."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    fused: str | None = None

    @property
    def steps(self) -> tuple[str, ...]:
        """The regexes to run, in order."""
        return (self.fused,) if self.fused is not None else self.regexes


DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
"""llama.cpp's ``default`` (also what it uses when ``tokenizer.ggml.pre`` is missing)."""

_LLAMA3_TYPE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
# Individual digits, then GPT-2's rules; fused: GPT-2's regex with each digit matched on its
# own and no longer after a space (no other branch matches a digit, so the order is free:
# after the letters is fastest), and whitespace before a digit taken whole (it ended a
# piece, where (?!\S) holds).
_STARCODER = PreTokenizer((r"\p{N}", _GPT2), fused=(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])"))
_GPT2_TYPE = PreTokenizer((_GPT2,))
_QWEN2_TYPE = PreTokenizer((_QWEN2,))
_DEEPSEEK3 = PreTokenizer((
    r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")))
_SEED_CODER = PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))
_BLOOM = PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3_TYPE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    "deepseek-v3": _DEEPSEEK3,
    "seed-coder": _SEED_CODER,
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b"), _STARCODER),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion",
                     "roberta-bpe", "jina-v1-en", "jina-v2-code", "exaone4"), _GPT2_TYPE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan"),
                    _QWEN2_TYPE),
    "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _BLOOM),
    "viking": PreTokenizer((_BLOOM.regexes[0], r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), PreTokenizer((_GPT4O,))),
}
"""``tokenizer.ggml.pre`` name -> its pre-tokenizer, for the names llama.cpp maps to the
types above (``llama_vocab::impl::load``; ``chatglm-bpe`` and ``glm4`` also have no BOS
token there, which their files' ``add_bos_token`` says here)."""
