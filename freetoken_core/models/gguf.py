"""The small files FreeToken derives from a GGUF file once: config and tokenizer.

A GGUF model's weights are read in place, from the file itself (``gguf_weights``); what is
kept in the cache is only what the rest of FreeToken reads from a Hugging Face directory,
with no network access:

* ``config.json`` - the Hugging Face config the GGUF metadata describes (``build_config``);
* ``tokenizer.json`` and ``tokenizer_config.json`` (with the named special tokens, the GGUF
  ``tokenizer.chat_template`` and, under ``fim_tokens``, the fill-in-the-middle tokens the
  metadata names), built from the GGUF vocabulary to tokenize as llama.cpp does
  (``gguf_tokenizer``);
* ``generation_config.json`` with the bos and pad token ids and, as ``eos_token_id``, every
  token llama.cpp ends generation on (:func:`end_of_generation_ids`: Phi-3's ``<|end|>``,
  Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>`` / ``<|eom_id|>`` beside the eos).

No weights are written (no float32 copy of the model). The directory is assembled in a
temporary sibling and moved into place with :func:`os.replace`, so an interrupted run never
leaves a half-written output directory behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_metadata import build_config, generation_config
from freetoken_core.models.gguf_reader import field, open_header
from freetoken_core.models.gguf_tokenizer import (
    EOG_TEXTS,
    build_tokenizer,
    read_vocab,
    tokenizer_config,
)
from freetoken_core.models.gguf_weights import check_tensors

__all__ = ["convert_gguf"]

# The fill-in-the-middle token ids a GGUF may name (llama.cpp's keys, the deprecated names
# second; llama.cpp's src/llama-vocab.cpp reads both), by the name under which their token
# text is recorded in tokenizer_config.json's ``fim_tokens``: pre(fix), suf(fix), mid(dle),
# as llama.cpp calls them.
_FILL_IN_MIDDLE_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
}

# The fill-in-the-middle pad / repo / file-separator tokens llama.cpp finds by text where the
# metadata names none (those end generation too, as the tokens of EOG_TEXTS do).
_FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                        "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                        "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.eom_token_id")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Write the config and tokenizer of the GGUF file ``gguf_path`` into ``out_dir``.

    Contract:

    * ``out_dir`` must not exist yet; its parent is created if needed. On success ``out_dir``
      is a complete directory (see the module docstring) and is returned. On any failure -
      including ``KeyboardInterrupt`` - ``out_dir`` is left untouched and the temporary
      directory is removed.
    * If another process finishes into ``out_dir`` while this one runs, the other result is
      kept and this one discarded.
    * ``progress`` is accepted for the callers' sake; the files take about a second.
    * Raises :class:`ModelLoadError` if the file is unreadable, of an architecture FreeToken
      does not run, or has no tokenizer FreeToken can build (none, or a model other than
      ``gpt2``, ``llama`` and ``gemma4``).
    """
    del progress
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelLoadError(f"{out_dir} already exists; delete it or choose another output dir")
    reader = open_header(gguf_path)
    config = build_config(reader)
    check_tensors(reader, gguf_path)  # a truncated file is named as such, not as a tokenizer
    vocab = read_vocab(gguf_path, reader)
    generation = generation_config(config)
    eog = end_of_generation_ids(reader, vocab.tokens)
    if eog and eog != [generation.get("eos_token_id")]:
        generation["eos_token_id"] = eog
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_sibling(out_dir)
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_tokenizer(tmp, reader, vocab, config)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------------
# tokenizer and files
# --------------------------------------------------------------------------------------------


def end_of_generation_ids(reader: Any, tokens: list[str]) -> list[int]:
    """The ids llama.cpp ends generation on (``special_eog_ids``, src/llama-vocab.cpp): the
    eos, eot and eom ids the metadata names; the fill-in-the-middle pad, repo and
    file-separator tokens (named by their keys, else found by text); every token whose text
    is in its list (``<|eot_id|>``, ``<|im_end|>``, ``<|end|>``, ``<end_of_turn>``,
    ``<|endoftext|>``, ...).
    As there, ``<|end|>`` is not one where the vocabulary also has ``<|return|>`` and
    ``<|call|>`` (or ``<|calls|>`` and ``<|flush|>``), and ``</s>`` is not one beside
    ``<|tool_response>`` or ``<|plamo:eos|>``. The eos first, the others in id order."""
    index = {text: i for i, text in enumerate(tokens)}  # a repeated text: its last id

    def named(key: str) -> int | None:
        value = field(reader, key)
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    eog = {index[text] for text in EOG_TEXTS if text in index}
    for key, texts in _FIM_EOG.items():
        found = named(key)
        if found is None:
            found = next((index[t] for t in texts if t in index), None)
        if found is not None:
            eog.add(found)
    eog |= {i for i in map(named, _EOG_KEYS) if i is not None}
    texts = {tokens[i] for i in eog}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts
                               or {"<|calls|>", "<|flush|>"} <= texts):
        eog.discard(index["<|end|>"])
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(index["</s>"])
    eos = named("tokenizer.ggml.eos_token_id")
    return sorted(eog, key=lambda i: (i != eos, i))


def _write_tokenizer(out_dir: Path, reader: Any, vocab: Any, config: dict[str, Any]) -> None:
    """Build the tokenizer from the GGUF's vocabulary (``gguf_tokenizer``: it tokenizes as
    llama.cpp does) and save it into ``out_dir`` as ``tokenizer.json`` and
    ``tokenizer_config.json``, which records the GGUF ``tokenizer.chat_template`` and the
    fill-in-the-middle tokens the metadata names (:func:`_fill_in_middle_tokens`)."""
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    data = tokenizer_config(vocab, field(reader, "tokenizer.chat_template"),
                            config["max_position_embeddings"])
    fill_in_middle = _fill_in_middle_tokens(reader, vocab.tokens)
    if fill_in_middle:
        data["fim_tokens"] = fill_in_middle
    _write_json(out_dir / "tokenizer_config.json", data)


def _fill_in_middle_tokens(reader: Any, tokens: list[str]) -> dict[str, str]:
    """``{"pre" | "suf" | "mid": token text}`` for the fill-in-the-middle token ids the GGUF
    metadata names (``tokenizer.ggml.fim_pre_token_id`` ...), each the text of that token;
    an id outside the vocabulary is ignored, as llama.cpp ignores it.

    They go under one key, ``fim_tokens``, rather than ``*_token`` keys: transformers 5
    takes every ``*_token`` key of tokenizer_config.json for a named special token, which
    would make the token special (dropped by ``skip_special_tokens``) or, for a text not in
    the vocabulary, add a token."""
    found: dict[str, str] = {}
    for name, keys in _FILL_IN_MIDDLE_KEYS.items():
        token_id = next((v for v in (field(reader, k) for k in keys) if v is not None), None)
        if token_id is not None and 0 <= int(token_id) < len(tokens) and tokens[int(token_id)]:
            found[name] = tokens[int(token_id)]
    return found


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented, key-sorted UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _make_temp_sibling(out_dir: Path) -> Path:
    """Create and return an empty, uniquely named hidden directory next to ``out_dir``.

    Unlike :func:`tempfile.mkdtemp` (mode 0700) it gets the normal umask-derived mode, which the
    finished model directory keeps after the rename.
    """
    while True:
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue
        return tmp


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Atomically rename the finished ``tmp`` to ``out_dir``.

    If ``out_dir`` appeared meanwhile and holds a finished conversion (a concurrent run won the
    race), keep it and delete ``tmp``; otherwise raise :class:`ModelLoadError`.
    """
    try:
        os.replace(tmp, out_dir)
    except OSError as exc:
        if (out_dir / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise ModelLoadError(
            f"cannot move the converted model into {out_dir} ({exc}); delete {out_dir} and retry"
        ) from exc
