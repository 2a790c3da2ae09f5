"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

The output directory holds everything ``AutoModelForCausalLM`` / ``AutoTokenizer`` need, with no
network access:

* ``config.json`` - a ``LlamaConfig`` dict read from the GGUF metadata;
* ``model.safetensors`` - every weight dequantized to float32 under its Hugging Face name, with
  the q/k rows un-permuted exactly as transformers' own GGUF loader does;
* ``tokenizer.json``, ``tokenizer_config.json`` (including the GGUF ``tokenizer.chat_template``),
  ``chat_template.jinja`` and ``special_tokens_map``-style fields, built by transformers;
* ``generation_config.json`` with the bos/eos (and pad) token ids.

Weights are converted and written one tensor at a time, so peak memory stays near the size of
the largest single tensor rather than the whole model. The directory is assembled in a
temporary sibling and moved into place with :func:`os.replace`, so an interrupted conversion
never leaves a half-written output directory behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import struct
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_metadata import (
    build_config,
    field,
    generation_config,
    open_header,
    open_reader,
)

__all__ = ["GGUF_BLOCK_TYPES", "convert_gguf", "read_gguf_blocks"]


# GGUF tensor name -> Hugging Face name; ``{i}`` is the layer index.
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Llama 3 stores its rope frequency factors as a tensor; transformers' loader ignores it too.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
# Keys transformers writes into tokenizer_config.json that only describe how it was loaded.
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "gguf_file")


@dataclass(frozen=True)
class _Planned:
    """One tensor to write: its GGUF source, Hugging Face name and float32 numpy shape."""

    tensor: Any  # gguf.ReaderTensor
    hf_name: str
    shape: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert the llama GGUF file ``gguf_path`` into the model directory ``out_dir``.

    Contract:

    * ``out_dir`` must not exist yet; its parent is created if needed. On success ``out_dir``
      is a complete directory (see the module docstring) and is returned. On any failure -
      including ``KeyboardInterrupt`` - ``out_dir`` is left untouched and the temporary
      directory is removed.
    * If another process finishes converting into ``out_dir`` while this one runs, the other
      result is kept and this one discarded.
    * ``progress`` shows a tqdm bar (on stderr) while tensors are converted.
    * Raises :class:`ModelLoadError` if the file is unreadable, not a llama GGUF, uses a
      quantization gguf-py cannot dequantize, or is missing tensors.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelLoadError(f"{out_dir} already exists; delete it or choose another output dir")
    reader = open_reader(gguf_path)
    config = build_config(reader)
    plan = _plan_tensors(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_sibling(out_dir)
    try:
        _write_safetensors(tmp / "model.safetensors", plan, config, progress=progress)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(config))
        _write_tokenizer(gguf_path, tmp, reader, config)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ggml type id -> bytes per block of 32 weights, for the block types FreeToken computes with
# directly (freetoken_core/kernels/csrc/gguf_linear.cpp).
GGUF_BLOCK_TYPES: dict[int, int] = {3: 20, 8: 34}  # Q4_1, Q8_0


def read_gguf_blocks(gguf_path: Path) -> dict[str, tuple[int, np.ndarray]]:
    """The quantized blocks of every 2-d weight of ``gguf_path`` stored as Q4_1 or Q8_0.

    ``{hf_name: (ggml type id, uint8 array [out, in / 32 * block bytes])}``: one row of
    blocks per output feature, q/k rows un-permuted like the float32 conversion, so that row
    ``n`` dequantizes to row ``n`` of the converted weight. Memory-mapped; nothing is copied
    until the caller copies it.
    """
    reader = open_header(Path(gguf_path))
    config = build_config(reader)
    heads = {"q_proj.weight": config["num_attention_heads"],
             "k_proj.weight": config["num_key_value_heads"]}
    blocks: dict[str, tuple[int, np.ndarray]] = {}
    for planned in _plan_tensors(reader, config):
        qtype = int(planned.tensor.tensor_type)
        if qtype not in GGUF_BLOCK_TYPES or len(planned.shape) != 2:
            continue
        rows = np.asarray(planned.tensor.data).reshape(planned.shape[0], -1)
        for tail, n_head in heads.items():
            if planned.hf_name.endswith(tail):
                rows = _reverse_permute(rows, n_head)
        blocks[planned.hf_name] = (qtype, rows)
    return blocks


# --------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------


def _hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``gguf_name``; ``None`` if it is not a llama one."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def _expected_names(config: dict[str, Any]) -> set[str]:
    """Every Hugging Face tensor name a ``LlamaForCausalLM`` with ``config`` needs."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{tail}" for tail in _LAYER_TENSORS.values())
    return names


def _plan_tensors(reader: Any, config: dict[str, Any]) -> list[_Planned]:
    """Map every GGUF tensor to its Hugging Face name and shape; check none is missing.

    GGUF shapes list the fastest-varying dimension first, so the numpy (row-major) shape is the
    reverse: e.g. ``ffn_down`` ``[1536, 576]`` becomes ``[576, 1536]`` = ``[out, in]``, the
    layout of ``torch.nn.Linear.weight``.
    """
    plan: list[_Planned] = []
    for tensor in reader.tensors:
        if tensor.name in _IGNORED_TENSORS:
            warnings.warn(
                f"GGUF tensor {tensor.name} (llama3 rope factors) is ignored, as transformers does",
                stacklevel=3,
            )
            continue
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has no LlamaForCausalLM equivalent; "
                "this converter only handles plain llama models"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        plan.append(_Planned(tensor, hf_name, shape))
    missing = _expected_names(config) - {p.hf_name for p in plan}
    if missing:
        raise ModelLoadError(
            f"GGUF file lacks {len(missing)} llama tensors (e.g. {min(missing)}); "
            "the file is incomplete - re-download it"
        )
    return plan


def _reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py`` ``permute``).

    llama.cpp interleaves the two rotary halves of every head; this restores the Hugging Face
    layout, exactly as ``transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor`` does.
    ``n_head`` is the query head count for q and the key/value head count for k.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(
            f"q/k projection with {rows} rows cannot be split into {n_head} heads; "
            "the GGUF metadata head counts are inconsistent - re-export the model"
        )
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _dequantize(planned: _Planned, config: dict[str, Any]) -> np.ndarray:
    """Dequantize one tensor to a contiguous little-endian float32 array in HF layout."""
    from gguf.quants import dequantize

    tensor = planned.tensor
    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) with this gguf "
            "version; upgrade it with: pip install -U gguf"
        ) from exc
    weights = np.asarray(weights).reshape(planned.shape)
    if planned.hf_name.endswith("q_proj.weight"):
        weights = _reverse_permute(weights, config["num_attention_heads"])
    elif planned.hf_name.endswith("k_proj.weight"):
        weights = _reverse_permute(weights, config["num_key_value_heads"])
    return np.ascontiguousarray(weights, dtype="<f4")


def _safetensors_header(plan: list[_Planned]) -> bytes:
    """The safetensors header (length prefix + JSON, padded to 8 bytes) for ``plan``."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for planned in plan:
        size = 4 * int(np.prod(planned.shape, dtype=np.int64))
        entries[planned.hf_name] = {
            "dtype": "F32",
            "shape": list(planned.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    body = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _write_safetensors(
    path: Path, plan: list[_Planned], config: dict[str, Any], *, progress: bool
) -> None:
    """Stream every planned tensor, dequantized to float32, into the safetensors file ``path``.

    The header is computed up front from the planned shapes, so only one tensor is ever held in
    memory; the result is a standard safetensors file readable by ``safetensors.safe_open``.
    """
    with open(path, "wb") as out:
        out.write(_safetensors_header(plan))
        for planned, weights in _iter_converted(plan, config, progress=progress):
            if weights.shape != planned.shape:  # pragma: no cover - guarded by reshape above
                raise ModelLoadError(f"{planned.hf_name} came out as {weights.shape}; report this")
            out.write(memoryview(weights).cast("B"))


def _iter_converted(
    plan: list[_Planned], config: dict[str, Any], *, progress: bool
) -> Iterator[tuple[_Planned, np.ndarray]]:
    """Yield ``(planned, float32 array)`` pairs in ``plan`` order, with an optional tqdm bar."""
    from tqdm.auto import tqdm

    bar = tqdm(plan, desc="converting GGUF", unit="tensor", disable=not progress, file=sys.stderr)
    with bar:
        for planned in bar:
            yield planned, _dequantize(planned, config)


# --------------------------------------------------------------------------------------------
# tokenizer and files
# --------------------------------------------------------------------------------------------


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader: Any, config: dict[str, Any]) -> None:
    """Build the tokenizer from the GGUF with transformers and save it into ``out_dir``.

    The GGUF ``tokenizer.chat_template`` is set on the tokenizer (transformers writes it to
    ``chat_template.jinja``) and also recorded under ``chat_template`` in
    ``tokenizer_config.json``, so loaders that only read that file find it too.
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
    _fix_tokenizer_config(out_dir / "tokenizer_config.json", template)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented, key-sorted UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fix_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Record ``chat_template`` in ``tokenizer_config.json`` and drop load-time-only keys.

    transformers 5 saves the loading flags ``is_local`` / ``local_files_only`` as init kwargs;
    they describe how the GGUF was read, not the tokenizer, so they are removed.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_KEYS:
        data.pop(key, None)
    if chat_template is not None:
        data["chat_template"] = chat_template
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
