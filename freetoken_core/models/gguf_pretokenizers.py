"""The pre-tokenizer of each GGUF ``tokenizer.ggml.pre`` type, as llama.cpp runs it.

llama.cpp (``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``) splits the text of a byte-level
BPE vocabulary (``tokenizer.ggml.model = gpt2``) with a list of regexes applied one after
the other: each regex cuts every piece left by the previous ones into its matches and the
text between them (``unicode_regex_split``), and only then are the pieces byte-encoded and
merged. :data:`PRE_TOKENIZERS` holds those lists for every name llama.cpp's
``llama_vocab::impl::load`` accepts for a ``gpt2`` vocabulary (it refuses any other name),
replayed by ``tokenizers``' ``Split(..., "isolated")`` steps, which have the same semantics.

The lists are llama.cpp's strings (its "adapted" forms where it adapts the original
tokenizer.json regex), rewritten only where llama.cpp's engine reads them otherwise than
Oniguruma would:

* a regex with a ``\\p{..}`` class runs on text collapsed to one code per category, where
  ``\\p{Lu}``, ``\\p{Ll}``, ``\\p{Lt}``, ``\\p{Lm}`` and ``\\p{Lo}`` all stand for any letter
  (:func:`_collapsed`; tekken / gpt-4o spell their case classes as look-aheads that survive);
* a regex without one runs on the code points with every non-ASCII space turned into
  ``\\v``, so a space inside a literal range (deepseek-llm's ``ࠀ-一`` and ``　-。``) never
  matches it, and ``\\d`` is ASCII there (superbpe's);
* some regexes are only names for hand-written splitters: kimi-k2's ``\\p{Han}+`` (letters
  and Han characters, :data:`_KIMI_K2`) and afmoe's and tiny_aya's digit groups, which also
  keep the text before a digit run in the piece of its first group (:data:`_DIGIT_GROUPS`).

A type llama.cpp gives ``ignore_merges`` (a word that is itself a token is taken whole) or
``add_bos`` by default says so in its :class:`PreTokenizer`; the file's
``tokenizer.ggml.add_bos_token`` overrides the latter. ``gemma4``,
``granite-embed-multi-311m`` and ``sarvam-moe`` are SentencePiece-style BPE
(``escape_whitespaces``, built by :mod:`gguf_tokenizer_gemma4`). ``whitespace`` (an embedding
model's split on spaces, its pieces not byte-encoded) is refused (:data:`REFUSED`).
``clean_spaces`` and ``add_sep``, which llama.cpp also sets per type, only change its
``llama_detokenize`` and its embedding / rerank inputs, neither of which FreeToken replays.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT", "PRE_TOKENIZERS", "REFUSED", "PreTokenizer", "unsupported_pre"]

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
# youtu's and tiny_aya's case classes (as tokenizer.json writes them; see _collapsed)
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?")
_PUNCT_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
                r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+")
_DEEPSEEK3_WORDS = _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_KANA_HAN = "[一-龥぀-ゟ゠-ヿ]+"
_NOT_SPACE = "&&[^\\s]]+"  # closes a literal class, less the spaces llama.cpp never sees there
_HAN = ("[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
        "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff"
        "\U0002f800-\U0002fa1f]")  # llama.cpp's unicode_cpt_is_han
# kimi-k2's splitter (unicode_regex_split_custom_kimi_k2): Han runs, then letter runs without
# Han (no marks, no case), numbers by three, GPT-4o's rest.
_KIMI_K2 = (f"{_HAN}+|[^\\r\\n\\p{{L}}\\p{{N}}]?(?:(?!{_HAN})\\p{{L}})+"
            r"(?:'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL]))?|\p{N}{1,3}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# afmoe's and tiny_aya's digit groups (unicode_regex_split_custom_afmoe): a run of numbers is
# cut into groups of three from the right, and the text since the previous group joins the
# next run's first group; \G keeps each search at the end of the previous match.
_DIGIT_GROUPS = r"\G\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_AFMOE_SCRIPTS = ("[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+")
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-"
    "ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴ"
    "ῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
_DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿" + _NOT_SPACE


def _collapsed(regex: str) -> str:
    """``regex`` as llama.cpp matches it on collapsed text: every letter class is any letter."""
    for cls in ("Lu", "Ll", "Lt", "Lm", "Lo"):
        regex = regex.replace(rf"\p{{{cls}}}", r"\p{L}")
    return regex


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes in order, and the defaults it sets.

    ``fused``, where set, is one regex that cuts text exactly as ``regexes`` one after the
    other do, and is what runs (one pass over the text instead of several: the default
    file's tokenizer is then as fast as transformers' conversion); tests check that the
    two cut every test text alike. ``escape_whitespaces``: a SentencePiece-style BPE
    (spaces written ``▁``, pieces merged on raw UTF-8, ``<0xNN>`` byte fallback);
    ``gemma4``: llama.cpp's Gemma 4 type (a run of newlines that is a token is taken whole,
    BOS always added)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    fused: str | None = None
    escape_whitespaces: bool = False
    gemma4: bool = False

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
_DEEPSEEK3 = PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3_WORDS))
_BLOOM = PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",))
_GPT4O_TYPE = PreTokenizer((_GPT4O,))
_SPM_STYLE = (r"[^\n]+|[\n]+",)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3_TYPE),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((_LLAMA3,), ignore_merges=True)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
                             ignore_merges=True),
    "jais-2": PreTokenizer((_LLAMA3.replace(r"\s+(?!\S)|\s+", "|".join(
        [rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)]
        + [r"\s{1,2}(?!\S)", r"\s{1}"])),)),
    # 、-。: llama.cpp's 　-。 less the ideographic space, which it never sees there
    "deepseek-llm": PreTokenizer((r"[\r\n]", _DEEPSEEK_LLM_LETTERS,
                                  r"\s?[!-/:-~！-／：-～‘-‟、-。]+", r"\s+$", _DEEPSEEK_CJK,
                                  r"\p{N}+")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK,
                                    r"\p{N}")),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _PUNCT_WORDS
                              + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    "youtu": PreTokenizer((
        "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _KANA_HAN,
        _collapsed(_CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
        ignore_merges=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), _STARCODER),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "jina-v1-en",
                     "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "exaone4"), _GPT2_TYPE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open", "grok-2"), _QWEN2_TYPE),
    "qwen35": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "ufakzeka": PreTokenizer((_QWEN2[len(_CONTRACTIONS) + 1:],)),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _BLOOM),
    "viking": PreTokenizer((_BLOOM.regexes[0], r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizer((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                               r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
                              add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_TYPE),
    "granite-embed-multi-97m": PreTokenizer((_GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),),
                                            ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), PreTokenizer((_DIGIT_GROUPS, _collapsed(
        _CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")))),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((
        (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"),))),
    "seed-coder": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                                r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    "afmoe": PreTokenizer((_DIGIT_GROUPS, _AFMOE_SCRIPTS, _DEEPSEEK3_WORDS)),
    "exaone-moe": PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), PreTokenizer(
        _SPM_STYLE, escape_whitespaces=True, gemma4=True, add_bos=True)),
    "sarvam-moe": PreTokenizer(_SPM_STYLE, escape_whitespaces=True),
}
"""``tokenizer.ggml.pre`` name -> its pre-tokenizer, for every name llama.cpp accepts for a
``gpt2`` vocabulary but :data:`REFUSED` (``llama_vocab::impl::load``; ``chatglm-bpe``,
``glm4`` and ``glm5`` also have no BOS token there unless the file names one, as it does)."""

REFUSED: dict[str, str] = {
    "whitespace": "llama.cpp's split on whitespace for embedding models "
                  "(jina-embeddings-v2-base-zh), whose pieces are not byte-encoded",
}
"""Names llama.cpp accepts that FreeToken does not build, with the reason."""


def unsupported_pre(pre: str) -> str | None:
    """Why ``tokenizer.ggml.pre = pre`` cannot be built, or None where it can."""
    if pre in PRE_TOKENIZERS:
        return None
    if pre in REFUSED:
        return (f"GGUF pre-tokenizer tokenizer.ggml.pre = {pre!r} is not supported: "
                f"{REFUSED[pre]}")
    return (f"unknown GGUF pre-tokenizer type tokenizer.ggml.pre = {pre!r} (llama.cpp "
            "refuses it too: 'unknown pre-tokenizer type'); FreeToken supports the names "
            "llama.cpp knows for 'gpt2' vocabularies: " + ", ".join(sorted(PRE_TOKENIZERS)))
