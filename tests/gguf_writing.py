"""Writing the tensors of a test's GGUF file as llama.cpp's converter and ``llama-quantize``
leave them: the helpers the family files (``gguf_<family>_files.py``) share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

ROUTER = ("ffn_gate_inp.weight",)
"""The names that stay F32 in every quantized file (a router's weight)."""


def add_tensor(writer: GGUFWriter, name: str, tensor: torch.Tensor, qtype: int,
               f32: Sequence[str] = ROUTER) -> torch.Tensor:
    """Write ``tensor`` (2-d or 3-d: row by row) as ``qtype``; F32 where it is 1-d, where
    ``name`` ends with one of ``f32`` or where its rows are not whole blocks of ``qtype``,
    as ``llama-quantize`` keeps them. Return the values written (gguf-py's dequantization)."""
    values = np.ascontiguousarray(tensor.detach().float().numpy())
    block = GGMLQuantizationType(qtype)
    if values.ndim == 1 or name.endswith(tuple(f32)) or (
            values.shape[-1] % GGML_QUANT_SIZES[block][0]):
        writer.add_tensor(name, values.astype(np.float32))
        return torch.from_numpy(values.copy())
    raw = quantize(values.reshape(-1, values.shape[-1]), block)
    raw = raw.reshape(*values.shape[:-1], -1)
    writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=block)
    return torch.from_numpy(np.asarray(dequantize(raw, block), dtype=np.float32).reshape(
        values.shape))


def finish(writer: GGUFWriter) -> None:
    """Write the file (header, metadata, tensors) and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_MODEL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(name: str, layer_names: dict[str, str]) -> str:
    """The converter's name of the checkpoint's tensor ``name``: the model's own tensors'
    (embedding, final norm, head), else ``blk.{i}.`` and ``layer_names`` of the name's rest
    after ``model.layers.{i}.``."""
    if name in _MODEL_TENSORS:
        return _MODEL_TENSORS[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{layer_names[rest]}"


def layer_of(name: str) -> int:
    """The layer of the checkpoint's tensor ``model.layers.{i}. ...``."""
    return int(name.split(".")[2])
