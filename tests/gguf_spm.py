"""A real SentencePiece tokenizer in a GGUF file, for the tests of the ``llama`` (SPM) path.

``train_spm`` trains a small SentencePiece BPE model the way Llama 2 / Mistral ones are
trained (byte fallback, digits split, whitespace-only pieces, identity normalization,
``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2) on a few paragraphs of mixed text made here;
``spm_gguf_fields`` gives the ``tokenizer.*`` fields llama.cpp's ``convert_hf_to_gguf.py``
writes for it (``_set_vocab_sentencepiece`` / ``_create_vocab_sentencepiece`` and gguf-py's
``SpecialVocab``), and ``write_spm_tokenizer_gguf`` a tensor-less GGUF holding only those,
to pass as ``tests/gguf_models.py`` ``write_gguf(..., tokenizer_from=...)``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from gguf_writing import finish

# Mistral v0.1's template (Llama 2's without the system prompt).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# gguf-py TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_PROSE = [
    "The tokenizer is trained on a few paragraphs of text, so that its pieces are real ones:",
    "common words become single pieces, rare words are cut into several, and characters it",
    "has never seen fall back to their UTF-8 bytes, one piece per byte.",
    "A model served in place from its GGUF file must split a prompt exactly as the model's",
    "own tokenizer did when it was trained; one piece more or less changes every logit after it.",
    "Numbers are split into single digits: 2024, 3.14159, 1,000,000 and 0x1F are all digit runs.",
]
_CODE = [
    "def tokenize(text: str) -> list[int]:",
    "    ids = [BOS]",
    "    for piece in split(text):",
    "        if piece in vocab:",
    "            ids.append(vocab[piece])",
    "        else:",
    "            ids.extend(byte_fallback(piece))",
    "    return ids",
    "",
    "class Cache:",
    "    def __init__(self, size=4096):",
    "        self.size = size  # tokens",
]
_CJK = [
    "東京は日本の首都です。今日は天気が良いので、公園を散歩しました。",
    "我们正在测试分词器。这个模型很小，但是它可以处理中文。",
    "한국어 문장도 조금 있습니다.",
]
_EMOJI = ["Emoji: 😀 🎉 👍 🚀 — and a café, naïve, Ünïcödé.", "Flags and families: 🇯🇵 👨‍👩‍👧"]


def training_lines(seed: int = 0) -> list[str]:
    """The training text, one sentence a line: fixed paragraphs of prose, indented code,
    digits, CJK and emoji, plus seeded made-up sentences that give BPE enough distinct
    words to learn ~1000 pieces from."""
    rng = random.Random(seed)
    syllables = ["ka", "ri", "to", "ne", "sa", "mi", "lo", "pe", "ur", "an", "th", "er", "in",
                 "on", "qu", "st", "ch", "ar", "ed", "ing", "ly", "pro", "con", "tion", "al",
                 "ex"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
             for _ in range(400)]
    lines = (_PROSE + _CODE) * 8 + _CJK * 4 + _EMOJI
    for _ in range(600):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        lines.append(sentence.capitalize() + rng.choice(".!?,;:"))
    for _ in range(100):
        lines.append(f"    item_{rng.randint(0, 99)} = {rng.randint(0, 99999)}"
                     f"  # {rng.randint(1, 12)}/{rng.randint(1, 28)}/20{rng.randint(10, 29)}")
    return lines


def train_spm(directory: Path, *, add_dummy_prefix: bool = True, vocab_size: int = 1000,
              seed: int = 0) -> Path:
    """Train a SentencePiece BPE model as Llama 2's (options from its ``tokenizer.model``
    trainer spec) into ``directory/tokenizer.model`` and return that path. Characters below
    the 99.5 % coverage (most CJK, the emoji) are left to byte fallback."""
    import sentencepiece as spm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines(seed)), model_prefix=str(prefix),
        model_type="bpe", vocab_size=vocab_size, character_coverage=0.995,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentencepiece_length=16, num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def spm_gguf_fields(model_path: Path, *, add_space_prefix: bool | None = None,
                    chat_template: str | None = CHAT_TEMPLATE
                    ) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """``(key, value, (GGUFValueType, [item type]))`` of the tokenizer fields llama.cpp's
    converter writes for the SentencePiece model ``model_path`` (a Llama-2-shaped model:
    no added tokens; bos/eos/unk ids from the model, ``add_bos_token`` true,
    ``add_eos_token`` false). ``add_space_prefix`` None omits the key, as the converter
    does for llama (llama.cpp then defaults it to true); Gemma's converter writes false."""
    from gguf import GGUFValueType as T
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_path))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = NORMAL
        if sp.IsUnknown(i):
            kind = UNKNOWN
        elif sp.IsControl(i):
            kind = CONTROL
        elif sp.IsUnused(i):
            kind = UNUSED
        elif sp.IsByte(i):
            kind = BYTE
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        types.append(kind)
    fields: list[tuple[str, Any, tuple[Any, ...]]] = [
        ("tokenizer.ggml.model", "llama", (T.STRING,)),
        ("tokenizer.ggml.pre", "default", (T.STRING,)),
        ("tokenizer.ggml.tokens", tokens, (T.ARRAY, T.STRING)),
        ("tokenizer.ggml.scores", scores, (T.ARRAY, T.FLOAT32)),
        ("tokenizer.ggml.token_type", types, (T.ARRAY, T.INT32)),
        ("tokenizer.ggml.bos_token_id", sp.bos_id(), (T.UINT32,)),
        ("tokenizer.ggml.eos_token_id", sp.eos_id(), (T.UINT32,)),
        ("tokenizer.ggml.unknown_token_id", sp.unk_id(), (T.UINT32,)),
        ("tokenizer.ggml.add_bos_token", True, (T.BOOL,)),
        ("tokenizer.ggml.add_eos_token", False, (T.BOOL,)),
    ]
    if add_space_prefix is not None:
        fields.append(("tokenizer.ggml.add_space_prefix", add_space_prefix, (T.BOOL,)))
    if chat_template is not None:
        fields.append(("tokenizer.chat_template", chat_template, (T.STRING,)))
    return fields


def write_spm_tokenizer_gguf(model_path: Path, out: Path, arch: str = "llama",
                             **options: Any) -> Path:
    """A GGUF file at ``out`` with no tensors and only the tokenizer fields of
    ``spm_gguf_fields(model_path, **options)``: the ``tokenizer_from`` of ``write_gguf``."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(out), arch)
    for key, value, kind in spm_gguf_fields(model_path, **options):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    finish(writer)
    return out
