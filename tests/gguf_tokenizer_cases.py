"""The texts and vocabularies of the GGUF tokenizer tests, and the script that records
llama.cpp's ids for them (tests/fixtures/gguf_tokenizer_ids.json).

Vocabularies: the default model's byte-level BPE vocabulary re-labelled with each
``tokenizer.ggml.pre`` type of :data:`PRE_TYPES` (one name of each pre-tokenizer FreeToken
builds; plus two user-defined tokens, as Qwen3's ``<think>``, a token no merge makes, and no
``add_bos_token``, so that each type's defaults show), and the SentencePiece model tests/gguf_spm.py trains, with and without
``add_space_prefix``. Each is written as a tensor-less GGUF holding only the tokenizer
fields (and the few hyper-parameters llama.cpp reads before a vocabulary), which both
FreeToken and llama.cpp (``vocab_only``) load; a third SentencePiece vocabulary is named
Phi-3, for llama.cpp's rule that its control tokens swallow the whitespace after them.
Gemma 4 (``tokenizer.ggml.model = gemma4``): the BPE tests/gguf_gemma4.py trains, in its three
variants of newline tokens, with the texts of :data:`GEMMA4_TEXTS` too; the same as ``gpt2``
vocabularies of the SentencePiece-style pre types (:data:`SPM_STYLE`). For every name of
``PRE_TOKENIZERS`` the fixture also holds the sha256 of llama.cpp's ids of every text
(``names``), over the default model's vocabulary or Gemma 4's ``lines``.

Regenerate the fixture, after changing a text or a vocabulary, with llama.cpp's
``llama-tokenize`` (``cmake --build ~/.cache/freetoken/llama.cpp/build --target
llama-tokenize`` after ``bench/build_llama_server.sh``)::

    python tests/gguf_tokenizer_cases.py ~/.cache/freetoken/llama.cpp/build/bin/llama-tokenize
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from gguf_writing import finish

FIXTURE = Path(__file__).parent / "fixtures" / "gguf_tokenizer_ids.json"
GPL3 = Path(__file__).parent / "fixtures" / "GPL-3"

PRE_TYPES = ("default", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "smollm",
             "gpt-4o", "tekken", "gpt-2", "starcoder", "falcon", "deepseek-v3", "bloom",
             "seed-coder", "dbrx", "glm4", "viking", "minicpm5", "jais-2", "deepseek-llm",
             "deepseek-coder", "spark2_5", "youtu", "qwen35", "ufakzeka", "laguna", "chameleon",
             "granite-embed-multi-97m", "tiny_aya", "superbpe", "bailingmoe", "kimi-k2",
             "afmoe", "exaone-moe")
# (pre, Gemma 4 variant): gpt2 vocabularies of the SentencePiece-style pre types
SPM_STYLE = (("gemma4", "lines"), ("sarvam-moe", "lines"), ("sarvam-moe", "merged"),
             ("sarvam-moe", "bytes"))
SPM_PREFIXES = (True, False)
PHI3_TOKENS = ("<|endoftext|>", "<|end|>", "<|user|>")  # llama.cpp's Phi-3 rule needs the first
USER_TOKENS = ("<think>", "</think>")  # user-defined (type 4), appended to the BPE vocab
WHOLE_TOKENS = ("Ġfibonacci",)  # no merge makes it: taken whole only with ignore_merges
# Merges appended to the BPE vocab (SmolLM2's has single digits only, and no punctuation
# joined to a newline): digits, so that the types that group digits (llama3's \p{N}{1,3})
# tokenize differently from the ones that split them (qwen2's \p{N}); and ':' with a newline
# ("Ċ"), so that the types whose punctuation takes the newlines after it (llama3's and
# qwen2's [\r\n]*) tokenize differently from the ones that split them off (seed-coder's).
EXTRA_MERGES = ("1 2", "12 3", "4 5", "45 6", ": Ċ")

# llama.cpp's converter check text (convert_hf_to_gguf_update.py CHK_TXT)
CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple "
          "emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 "
          "3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
          "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE "
          "you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")

CODE = ("def fibonacci(n: int) -> int:\n    \"\"\"The n-th number.\"\"\"\n    a, b = 0, 1\n"
        "    for _ in range(n):\n        a, b = b, a + b\n    \n        \n    return a\n\n"
        "\tif x:\n\t\treturn {\"key\": [1, 2, 3]}  # tabs\n\n\nclass Cache:\n"
        "    def __init__(self, size=4096):\n        self.size = size  \n")
LISTS = ("1. First item\n2. Second item\n   - nested bullet\n10. Tenth item\n\n"
         "CONDITIONS\n\n  0. Definitions.\n\n  1. Source Code.\n  12) twelve\n (a) x\n")
DIGITS = ("0 12 345 6789 12345 123456 1234567 3.14159265358979 1,000,000 2024-06-30 "
          "0xDEADBEEF 1e-9 00000000000000000000 99999999 ١٢٣ ４２ ½ ²³")
CJK = ("東京は日本の首都です。我们正在测试分词器，这是第二句。한국어 문장입니다. "
       "カタカナ ｶﾀｶﾅ 漢字かな交じり文")
EMOJI = ("Emoji: 😀🎉 👍🏽 🇯🇵 👨‍👩‍👧 🚀 — café, naïve, Ünïcödé ™ É À aÉb "
         "Straße ǅ İstanbul e\u0301\u0301 \u00a0nbsp\u2003em\u3000ideo")
CAMEL = ("JavaScript TypeScript iPhone McDonald's XMLHttpRequest getElementById "
         "camelCaseWord HTTPServer iOS macOS they'RE WE'LL it's/path//x://\n\n/\r\n")
PROSE = ("Tokenizers split text into pieces. It's what they've done; I'll say we'd "
         "DON'T shout. \"Quotes\" and 'these' (parens) [brackets] {braces} a--b ... ?!\n"
         "   leading spaces, trailing spaces   \n\r\nCRLF\rCR\x0b\x0c\u2028end  ")
# The branches of the later pre types: numbers of other scripts and digit runs of each length
# after text, two spaces, punctuation (afmoe's and tiny_aya's groups, superbpe's ASCII \d);
# Han beside kana, Hangul syllables and jamo, Bopomofo, Thai, Khmer, Myanmar, fullwidth and
# CJK punctuation around an ideographic space (deepseek-llm's, youtu's and afmoe's script
# ranges, kimi-k2's Han); combining marks after letters and alone (qwen35, exaone-moe);
# words joined by one space (exaone-moe); Chameleon's sentinel and image texts, tabs and
# runs of 2, 4, 8 and 17 spaces (jais-2); contractions, Turkish suffixes (ufakzeka).
SCRIPTS = ("١٢٣٤٥ ４２４２４ ²³⁴⁵ ⅫⅣ x1 y12 z1234 w1234567 v  12345 u\t123456, (7890)\n"
           "漢字と仮名、カタカナ。ひらがな 中文𠀀豈豈 한국어ㄱㄴᄀ ㄅㄆㄇ ภาษาไทย ខ្មែរ မြန်မာ "
           "！“引用”…—：；，。\u3000。「括弧」\n"
           "हिन्दी नमस्ते a\u0301b \u0301x ́ Ωmega ℂ K µ İstanbul'da Ankara'ya we'RE I'M "
           "one two three  four\n<sentinel:12> IMGIMGABZ IMGIMGAAAAAZ\t\ttab    four  two"
           "        eight                 seventeen  $+<=>^`|~ ©®±×÷€ //x\r\n  end   ")


# Gemma 4's: runs of newlines that are tokens and longer ones, runs of spaces, a chat turn with
# its user-defined tokens, </s> (normal there), a tab (a byte) and a byte token's text, also
# as a whole line (merged as any line: llama.cpp takes only a newline run whole).
GEMMA4_TEXTS = {
    "newlines": ("\n\nA\nB\n\nC\n\n\nD\n\n\n\nE\n\n\n\n\nF\n\n\n\n\n\nG"
                 "\n\n\n\n\n\n\n\nH\n \n\n \n\n\n\n"),
    "blanks": "  two leading, trailing two  \na  b   c    d     e\n \t \n     \n  ",
    "chat": ("<bos><|turn>user\nWhat is the weather in Paris?<turn|>\n<|turn>model\n<|channel>"
             "thought\nCall the tool.<channel|><|tool_call>call:get{city:<|\"|>Paris<|\"|>}"
             "<tool_call|><|tool_response>response:get{t:21}<tool_response|>It is 21 C."
             "<turn|></s> <eos>"),
    "literal": "a <0x41> b <0x0A>\n<0x41>\n<unk>x<pad><mask>",
}


def case_texts(case: str, special: list[str]) -> dict[str, str]:
    """Name -> text of vocabulary ``case``: :func:`texts`, and for Gemma 4's (also as
    ``gpt2``) :data:`GEMMA4_TEXTS`."""
    gemma4 = case.startswith(("gemma4", "spmbpe"))
    return {**texts(special), **(GEMMA4_TEXTS if gemma4 else {})}


def texts(special: list[str]) -> dict[str, str]:
    """Name -> text; ``special`` is the vocabulary's special tokens, written as text."""
    joined = " ".join(special)
    return {
        "chktxt": CHKTXT, "code": CODE, "lists": LISTS, "digits": DIGITS, "cjk": CJK,
        "emoji": EMOJI, "camel": CAMEL, "prose": PROSE, "scripts": SCRIPTS, "empty": "",
        "space": " ", "spaces": "   x",
        "specials": f"{joined}\n{''.join(special)}x{special[0]} y {special[-1]}\n",
        "mixed": f"{special[0]}{CODE[:60]}{special[-1]} 12 {CJK[:12]} {EMOJI[:20]}",
    }


def special_texts(vocab: Any) -> list[str]:
    """The texts of the control, unknown and user-defined tokens of a ``GGUFVocab``."""
    return [t for t, kind in zip(vocab.tokens, vocab.types) if kind in (2, 3, 4) and t]


@cache
def _fields_of(source: Path) -> list[tuple[str, Any, Any]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_models import _tokenizer_fields

    return _tokenizer_fields(source)


def write_tokenizer_gguf(fields: list[tuple[str, Any, Any]], out: Path,
                         name: str | None = None) -> Path:
    """A GGUF at ``out`` with no tensors: ``fields`` (``(key, value, kinds)``), the few
    hyper-parameters llama.cpp reads before the vocabulary (it loads such a file with
    ``vocab_only``, as llama-tokenize does) and ``general.name`` if given."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(out), "llama")
    if name is not None:
        writer.add_name(name)
    for key, value in (("context_length", 2048), ("embedding_length", 64), ("block_count", 2),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    for key, value, kind in fields:
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    finish(writer)
    return out


def bpe_tokenizer_gguf(pre: str | None, directory: Path, model: str = "gpt2",
                       extra: tuple[tuple[str, Any, Any], ...] = ()) -> Path:
    """The default model's vocabulary labelled ``pre`` (None: no ``tokenizer.ggml.pre``),
    with the tokens of :data:`EXTRA_MERGES` and :data:`WHOLE_TOKENS` and the user-defined
    :data:`USER_TOKENS` appended, without ``add_bos_token``, as a tokenizer-only GGUF in
    ``directory`` (``model``: its ``tokenizer.ggml.model``; ``extra``: more fields)."""
    from gguf import GGUFValueType as T

    from freetoken_core.models.resolve import default_gguf_path

    fields = []
    for key, value, kind in _fields_of(default_gguf_path()):
        if key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.pre"):
            continue
        if key == "tokenizer.ggml.model":
            value = model
        elif key == "tokenizer.ggml.tokens":
            value = (value + [m.replace(" ", "") for m in EXTRA_MERGES] + list(USER_TOKENS)
                     + list(WHOLE_TOKENS))
        elif key == "tokenizer.ggml.token_type":
            value = (value + [1] * len(EXTRA_MERGES) + [4] * len(USER_TOKENS)
                     + [1] * len(WHOLE_TOKENS))
        elif key == "tokenizer.ggml.merges":
            value = value + list(EXTRA_MERGES)
        fields.append((key, value, kind))
    if pre is not None:
        fields.append(("tokenizer.ggml.pre", pre, (T.STRING,)))
    return write_tokenizer_gguf(fields + list(extra), directory / f"bpe-{pre}-{model}.gguf")


def spm_tokenizer_gguf(prefix: bool, directory: Path, phi3: bool = False) -> tuple[Path, str]:
    """The SentencePiece model tests/gguf_spm.py trains (``add_dummy_prefix=prefix``) as a
    tokenizer-only GGUF in ``directory`` (``add_space_prefix`` written only when false,
    as llama's converter omits it and Gemma's writes false), and the sha256 of its
    vocabulary, scores and types (training must give the fixture's vocabulary). ``phi3``:
    named "Phi-3 Mini", with Phi-3's control tokens :data:`PHI3_TOKENS` appended (llama.cpp
    then strips the whitespace after control tokens)."""
    from gguf_spm import spm_gguf_fields, train_spm

    model = train_spm(directory / f"spm-{prefix}", add_dummy_prefix=prefix)
    fields = spm_gguf_fields(model, add_space_prefix=None if prefix else False)
    digest = hashlib.sha256(json.dumps(
        [v for k, v, _ in fields if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                          "tokenizer.ggml.token_type")]).encode())
    if phi3:
        extra = {"tokenizer.ggml.tokens": list(PHI3_TOKENS),
                 "tokenizer.ggml.token_type": [3] * len(PHI3_TOKENS),
                 "tokenizer.ggml.scores": [0.0] * len(PHI3_TOKENS)}
        fields = [(k, v + extra[k] if k in extra else v, kind) for k, v, kind in fields]
        return (write_tokenizer_gguf(fields, directory / "spm-phi3.gguf", "Phi-3 Mini"),
                digest.hexdigest())
    return write_tokenizer_gguf(fields, directory / f"spm-{prefix}.gguf"), digest.hexdigest()


def gemma4_tokenizer_gguf(variant: str, directory: Path, add_bos: bool | None = True,
                          pre: str | None = None) -> tuple[Path, str]:
    """The Gemma 4 vocabulary ``variant`` of tests/gguf_gemma4.py as a tokenizer-only GGUF in
    ``directory``, and its hash; with ``pre``, as a ``gpt2`` vocabulary of that pre type."""
    from gguf import GGUFValueType as T
    from gguf_gemma4 import gemma4_fields

    fields, digest = gemma4_fields(variant, add_bos)
    if pre is not None:
        fields = [(k, "gpt2" if k == "tokenizer.ggml.model" else v, kind)
                  for k, v, kind in fields] + [("tokenizer.ggml.pre", pre, (T.STRING,))]
    out = directory / f"gemma4-{variant}-{add_bos}-{pre}.gguf"
    return write_tokenizer_gguf(fields, out), digest


def vocabularies(directory: Path) -> dict[str, tuple[Path, str]]:
    """Name (``bpe-<pre>`` / ``spm-<prefix>`` / ``spm-phi3`` / ``gemma4-<variant>`` /
    ``spmbpe-<pre>-<variant>``) -> (tokenizer-only GGUF, vocabulary hash)."""
    from gguf_gemma4 import VARIANTS

    out = {f"bpe-{pre}": (bpe_tokenizer_gguf(pre, directory), "") for pre in PRE_TYPES}
    for prefix in SPM_PREFIXES:
        out[f"spm-{prefix}"] = spm_tokenizer_gguf(prefix, directory)
    out["spm-phi3"] = spm_tokenizer_gguf(True, directory, phi3=True)
    for variant in VARIANTS:
        out[f"gemma4-{variant}"] = gemma4_tokenizer_gguf(variant, directory)
    for pre, variant in SPM_STYLE:  # add_bos false: llama.cpp overrides it for gemma4 only
        out[f"spmbpe-{pre}-{variant}"] = gemma4_tokenizer_gguf(variant, directory, False, pre)
    return out


def name_file(pre: str, directory: Path) -> Path:
    """The vocabulary of :func:`names_digests` for ``tokenizer.ggml.pre = pre``."""
    from freetoken_core.models.gguf_pretokenizers import PRE_TOKENIZERS

    if PRE_TOKENIZERS[pre].escape_whitespaces:
        return gemma4_tokenizer_gguf("lines", directory, False, pre)[0]
    return bpe_tokenizer_gguf(pre, directory)


def ids_digest(ids: list[list[int]]) -> str:
    """The sha256 of a list of id lists (one a text, in text order)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def _llama_tokenize(binary: Path, model: Path, text: str, scratch: Path) -> list[int]:
    """llama.cpp's ids of ``text`` with add_special (BOS/EOS as the model says) and
    parse_special, as llama-server's /tokenize gives them for a prompt."""
    prompt = scratch / "prompt.txt"
    prompt.write_bytes(text.encode("utf-8"))
    out = subprocess.run([str(binary), "-m", str(model), "-f", str(prompt), "--ids",
                          "--no-escape", "--log-disable"], check=True, capture_output=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def regenerate(binary: Path) -> None:
    """Write :data:`FIXTURE` from llama.cpp's ``llama-tokenize`` at ``binary``."""
    from freetoken_core.models.gguf_pretokenizers import PRE_TOKENIZERS
    from freetoken_core.models.gguf_reader import open_header
    from freetoken_core.models.gguf_tokenizer import read_vocab
    from freetoken_core.models.resolve import default_gguf_path

    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for name, (path, digest) in vocabularies(scratch).items():
            items = case_texts(name, special_texts(read_vocab(path, open_header(path))))
            cases[name] = {"vocab_sha256": digest, "texts": items, "ids": {
                key: _llama_tokenize(binary, path, text, scratch) for key, text in items.items()}}
            print(name, sum(map(len, cases[name]["ids"].values())), "ids", flush=True)
        gpl3 = _llama_tokenize(binary, default_gguf_path(), GPL3.read_text(encoding="utf-8"),
                               scratch)
        names = {}
        for pre in sorted(PRE_TOKENIZERS):
            path = name_file(pre, scratch)
            items = case_texts(f"spmbpe-{pre}" if PRE_TOKENIZERS[pre].escape_whitespaces else "",
                               special_texts(read_vocab(path, open_header(path))))
            names[pre] = ids_digest([_llama_tokenize(binary, path, text, scratch)
                                     for text in items.values()])
            path.unlink()
    version = subprocess.run([str(binary), "--version"], check=False, capture_output=True,
                             text=True)
    data = {"llama_cpp": (version.stdout + version.stderr).strip().splitlines()[0],
            "cases": cases, "gpl3_smollm": gpl3, "names": names}
    text = json.dumps(data, ensure_ascii=False, indent=1)
    # one line per id list
    text = re.sub(r"\[\n[\d,\s]*\]", lambda m: "[" + " ".join(m.group().split())[1:-1].strip()
                  + "]", text)
    FIXTURE.write_text(text + "\n", encoding="utf-8")
    print("wrote", FIXTURE, "GPL-3:", len(gpl3), "ids")

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    regenerate(Path(sys.argv[1]).expanduser())
