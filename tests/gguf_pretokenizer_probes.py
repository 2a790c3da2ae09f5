"""Short texts and the pieces llama.cpp's pre-tokenizer cuts them into, for the pre types whose
regexes the id fixture cannot tell apart from others' (over the default model's vocabulary,
most of their cuts merge to the same ids) or whose regexes FreeToken adapts (see
``freetoken_core/models/gguf_pretokenizers.py``): digit groups and the text they keep (afmoe,
tiny_aya), ASCII-only digit groups (superbpe), spaces in literal ranges (deepseek-llm,
deepseek-coder), collapsed case classes (youtu, tiny_aya), Han and letters without marks
(kimi-k2), marks in letter runs (qwen35, exaone-moe, granite-embed-multi-97m), words joined
by one space (exaone-moe), Chameleon's sentinels, image texts, tabs and space pairs, jais-2's
space runs, contractions (ufakzeka none, bailingmoe's spelling), lines (laguna), single
digits (spark2_5, viking, deepseek-coder).

The pieces are llama.cpp's: tests/gguf_pretokenizers_llamacpp_check.py reads them from
``llama-tokenize`` over a vocabulary in which every substring of the text is a token that
merges make, so that each piece comes back as one token.
"""

from __future__ import annotations

PROBES: dict[str, list[tuple[str, list[str]]]] = {
    "afmoe": [
        ("ab  12345 x1234567,  8",
         ["ab", " ", " ", "12", "345", " x", "1", "234", "567", ",", " ", " ", "8"]),
        ("中文12ไทย ក 1234 x",
         ["中文", "12", "ไ", "ทย", " ", "ក", " ", "1", "234", " x"]),
        ("a\u0301b ab12 'x",
         ["a\u0301b", " ab", "12", " '", "x"]),
    ],
    "tiny_aya": [
        ("JavaScript HTTPServer McDonald'S",
         ["JavaScript", " HTTPServer", " McDonald'S"]),
        ("x  1234567 ½12",
         ["x", " ", " ", "1", "234", "567", " ", "½12"]),
        ("a\u0301 \u0301b ΩMega",
         ["a\u0301", " \u0301b", " ΩMega"]),
    ],
    "superbpe": [
        ("١٢٣٤ 12345 ４２４２",
         ["١٢٣٤", " ", "12", "345", " ", "４２４２"]),
        ("ab  1234567 x½1234",
         ["ab  ", "1", "234", "567", " x", "½1", "234"]),
    ],
    "deepseek-llm": [
        ("a。\u3000。b\u3000漢字\u3000かな",
         ["a", "。", "\u3000", "。", "b", "\u3000", "漢字", "\u3000", "かな"]),
        ("a!\u3000!b\u3000。 x",
         ["a", "!", "\u3000!", "b", "\u3000", "。", " x"]),
        ("ª ƻʔ Ωmega ǅ 12x",
         ["ª ƻʔ", " Ω", "mega", " ǅ", " ", "12", "x"]),
        ("ह\u093fन\u094dद\u0940 عربي  \n\n  x ",
         ["ह\u093fन\u094dद\u0940", " عربي", "  ", "\n", "\n", " ", " x", " "]),
    ],
    "deepseek-coder": [
        ("a。\u3000漢字\u3000かな!? x",
         ["a", "。", "\u3000", "漢字", "\u3000", "かな", "!?", " x"]),
        ("ภาษา\u3000ไทย\u2003한국 x",
         ["ภาษา", "\u3000", "ไทย", "\u2003", "한국", " x"]),
        ("hi12 ab,  \n\n x",
         ["hi", "1", "2", " ab", ",", "  ", "\n", "\n", " x"]),
    ],
    "youtu": [
        ("JavaScript 한국어ㄱ ㄅㄆ",
         ["JavaScript", " ", "한국어ㄱ", " ", "ㄅㄆ"]),
        ("x한국어y漢字zㄅa！b",
         ["x", "한국어", "y", "漢字", "z", "ㄅ", "a", "！", "b"]),
        ("漢字かな！，…“引”  x12",
         ["漢字かな", "！，…“", "引", "”", " ", " x", "1", "2"]),
        ("it'S a\u0301b  /\n",
         ["it'S", " a\u0301b", " ", " /\n"]),
    ],
    "kimi-k2": [
        ("中文abc漢字Déjà vú",
         ["中文", "abc", "漢字", "Déjà", " vú"]),
        ("x'Re 12345 𠀀豈",
         ["x'Re", " ", "123", "45", " ", "𠀀豈"]),
        ("a\u0301b \u0301 〇々",
         ["a", "\u0301b", " \u0301", " ", "〇", "々"]),
    ],
    "qwen35": [
        ("a\u0301b \u0301x é",
         ["a\u0301b", " \u0301x", " é"]),
        ("it's  \u0301\u0301!\n\n x",
         ["it", "'s", " ", " \u0301\u0301", "!\n\n", " x"]),
    ],
    "exaone-moe": [
        ("one two  three\u0301 x/\n\n y",
         ["one two", " ", " three\u0301 x", "/\n", "\n", " y"]),
        ("a b1 c'S /x\n",
         ["a b", "1", " c", "'S", " /", "x", "\n"]),
    ],
    "chameleon": [
        ("<sentinel:12><sentinel:x> IMGIMGABZ",
         ["<", "sentinel", ":", "1", "2", ">", "<", "sentinel", ":", "x", ">", " ", "IMGIMGABZ"]),
        ("xIMGIMGABCDZy aIMGIMGABCDEZb",
         ["x", "IMGIMGABCDZ", "y", " aIMGIMGABCDEZb"]),
        ("IMGIMGAAAAAZ\t\tx    y  z",
         ["IMGIMGAAAAAZ", "\t", "\t", "x", "    ", "y", "  ", "z"]),
        ("12!? it's a-b",
         ["1", "2", "!", "?", " it", "'", "s", " a", "-", "b"]),
    ],
    "jais-2": [
        ("a                    b     \n",
         ["a", "                ", "  ", " ", " b", "     \n"]),
        ("x   y         z  ",
         ["x", "  ", " y", "        ", " z", "  "]),
    ],
    "granite-embed-multi-97m": [
        ("HTTPServer hi\u0301ndí x",
         ["HTTPServer", " hi\u0301ndí", " x"]),
        ("a\u0301B\u0301c it'S 1234",
         ["a\u0301", "B\u0301c", " it'S", " ", "123", "4"]),
    ],
    "ufakzeka": [
        ("İstanbul'da it's we'RE",
         ["İstanbul", "'da", " it", "'s", " we", "'RE"]),
        ("x  12 ab\n\n",
         ["x", " ", " ", "1", "2", " ab", "\n\n"]),
    ],
    "laguna": [
        ("a\n\nb  c\n d",
         ["a", "\n\n", "b", " ", " c", "\n", " d"]),
        ("it's 12\r\n\r\nx",
         ["it", "'s", " ", "1", "2", "\r", "\n", "\r", "\n", "x"]),
    ],
    "minicpm5": [
        ("1234567 x12 a  b",
         ["123", "456", "7", " x", "12", " a", " ", " b"]),
        ("it's ½12 \n\n",
         ["it", "'s", " ", "½12", " \n\n"]),
    ],
    "spark2_5": [
        ("1234 中文abc!?\n\n x",
         ["1", "2", "3", "4", " ", "中文", "abc", "!?", "\n", "\n", " x"]),
        ("かなabc ,x  y",
         ["かな", "abc", " ,", "x", " ", " y"]),
    ],
    "bailingmoe": [
        ("it's\n\n\n x",
         ["it", "'s", "\n\n\n", " x"]),
        ("it'sx WE'LLy 'd",
         ["it", "'s", "x", " WE", "'LL", "y", " '", "d"]),
        ("WE'LL  a1\r\n",
         ["WE", "'LL", " ", " a", "1", "\r\n"]),
    ],
    "viking": [
        ("abc 1234, x",
         ["abc", " ", "1", "2", "3", "4", ",", " x"]),
        ("a.b!?…c 12",
         ["a", ".", "b", "!?…", "c", " ", "1", "2"]),
    ],
}
"""``tokenizer.ggml.pre`` name -> (text, llama.cpp's pieces of it)."""
