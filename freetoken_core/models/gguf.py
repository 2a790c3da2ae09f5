"""The small files FreeToken derives from a GGUF file once: config and tokenizer.

A GGUF model's weights are read in place, from the file itself (``gguf_weights``); what is
kept in the cache is only what the rest of FreeToken reads from a Hugging Face directory,
with no network access:

* ``config.json`` - the Hugging Face config the GGUF metadata describes (``build_config``);
* ``tokenizer.json``, ``tokenizer_config.json`` (including the GGUF ``tokenizer.chat_template``
  and, under ``fim_tokens``, the fill-in-the-middle tokens the metadata names),
  ``chat_template.jinja`` and ``special_tokens_map``-style fields, built by transformers;
* ``generation_config.json`` with the bos/eos (and pad) token ids.

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
from freetoken_core.models.gguf_metadata import (
    build_config,
    field,
    generation_config,
    open_header,
)
from freetoken_core.models.gguf_weights import check_tensors

__all__ = ["convert_gguf"]

# Keys transformers writes into tokenizer_config.json that only describe how it was loaded.
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "gguf_file")

# The fill-in-the-middle token ids a GGUF may name (llama.cpp's keys, the deprecated names
# second; llama.cpp's src/llama-vocab.cpp reads both), by the name under which their token
# text is recorded in tokenizer_config.json's ``fim_tokens``: pre(fix), suf(fix), mid(dle),
# as llama.cpp calls them.
_FILL_IN_MIDDLE_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
}


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
      does not run, or has a tokenizer transformers cannot build.
    """
    del progress
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelLoadError(f"{out_dir} already exists; delete it or choose another output dir")
    reader = open_header(gguf_path)
    config = build_config(reader)
    check_tensors(reader, gguf_path)  # a truncated file is named as such, not as a tokenizer
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_sibling(out_dir)
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(config))
        _write_tokenizer(gguf_path, tmp, reader, config)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------------
# tokenizer and files
# --------------------------------------------------------------------------------------------


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader: Any, config: dict[str, Any]) -> None:
    """Build the tokenizer from the GGUF with transformers and save it into ``out_dir``.

    The GGUF ``tokenizer.chat_template`` is set on the tokenizer (transformers writes it to
    ``chat_template.jinja``) and also recorded under ``chat_template`` in
    ``tokenizer_config.json``, so loaders that only read that file find it too. The
    fill-in-the-middle tokens the metadata names are recorded there too
    (:func:`_fill_in_middle_tokens`).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as exc:
        raise ModelLoadError(
            f"transformers could not build the tokenizer of {gguf_path} ({exc}); "
            "upgrade transformers or use a GGUF with an embedded tokenizer"
        ) from exc
    template = field(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(out_dir))
    _fix_tokenizer_config(out_dir / "tokenizer_config.json", template,
                          _fill_in_middle_tokens(reader, tokenizer))


def _fill_in_middle_tokens(reader: Any, tokenizer: Any) -> dict[str, str]:
    """``{"pre" | "suf" | "mid": token text}`` for the fill-in-the-middle token ids the GGUF
    metadata names (``tokenizer.ggml.fim_pre_token_id`` ...), each the tokenizer's token for
    that id; an id outside the vocabulary is ignored, as llama.cpp ignores it.

    They go under one key, ``fim_tokens``, rather than ``*_token`` keys: transformers 5
    takes every ``*_token`` key of tokenizer_config.json for a named special token, which
    would make the token special (dropped by ``skip_special_tokens``) or, for a text not in
    the vocabulary, add a token."""
    tokens: dict[str, str] = {}
    for name, keys in _FILL_IN_MIDDLE_KEYS.items():
        token_id = next((v for v in (field(reader, k) for k in keys) if v is not None), None)
        if token_id is None or not 0 <= int(token_id) < len(tokenizer):
            continue
        text = tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(text, str) and text:
            tokens[name] = text
    return tokens


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented, key-sorted UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fix_tokenizer_config(path: Path, chat_template: str | None,
                          fill_in_middle: dict[str, str] | None = None) -> None:
    """Record ``chat_template`` (and, when the GGUF names them, the fill-in-the-middle tokens
    as ``fim_tokens``) in ``tokenizer_config.json`` and drop load-time-only keys.

    transformers 5 saves the loading flags ``is_local`` / ``local_files_only`` as init kwargs;
    they describe how the GGUF was read, not the tokenizer, so they are removed. Extra keys
    such as ``fim_tokens`` come back as the loaded tokenizer's ``init_kwargs``.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_KEYS:
        data.pop(key, None)
    if chat_template is not None:
        data["chat_template"] = chat_template
    if fill_in_middle:
        data["fim_tokens"] = dict(fill_in_middle)
    _write_json(path, data)


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
