"""A GGUF file's weights, read in place.

:func:`read_gguf_weights` maps the file (read-only, ``numpy.memmap``), checks every tensor
against its type and shape before anything is allocated, and hands each 2-d weight to the
model as a :class:`GGUFWeight`: the file's blocks of that tensor, under its Hugging Face
name, rows in Hugging Face order. The model keeps them as they are (in the native kernels'
layout, ``block_layout.kernel_blocks``: the same bytes, interleaved) and never makes a float32
copy; 1-d tensors (norms, biases) become small float32 tensors. Once the model is built
nothing refers to the mapping any more and its pages leave the process: peak RSS is the
model's blocks plus the KV cache and activations (docs/operations.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.hugepages import PAGE, madvise_dontneed
from freetoken_core.models import gguf_apertus, gguf_falcon_h1, gguf_nemotron_h, gguf_qwen35
from freetoken_core.models.gguf_mamba2 import hf_mamba2_weights
from freetoken_core.models.gguf_metadata import ROPE_FACTOR_TENSORS
from freetoken_core.models.gguf_names import MIXER_OUTPUTS, PERMUTED_QK, hf_name

if TYPE_CHECKING:
    import torch

__all__ = ["GGUF_TYPES", "GGUFWeight", "read_gguf_weights"]

# ggml type id -> (name, weights per block, bytes per block): the types FreeToken computes
# with (freetoken_core/kernels/csrc/gguf_types.h decodes each, bit for bit as gguf-py does).
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 22: ("IQ2_S", 256, 82),
    18: ("IQ3_XXS", 256, 98), 21: ("IQ3_S", 256, 110), 19: ("IQ1_S", 256, 50),
    29: ("IQ1_M", 256, 56),
}

@dataclass(frozen=True)
class GGUFWeight:
    """One 2-d weight as its GGUF file stores it.

    ``rows`` is uint8 ``[out, in / weights per block * bytes per block]``: one row of blocks
    per output feature, in Hugging Face order (llama q/k rows un-permuted). Row ``n``
    dequantizes to row ``n`` of the Hugging Face weight (``dequantize``). The rows stay in
    the file's mapping (``mapped``) in the file's order; where that is not Hugging Face's,
    ``order`` says which mapped row each row is, and ``rows`` makes the reordered copy when
    the weight is laid out, one weight at a time (made when the file was read, the q/k
    copies of every layer and the file pages they came from were all resident at once
    while the model was built: ~400 MiB of a 3B-shaped model's load peak)."""

    name: str
    """The tensor's name in the file (for messages)."""
    qtype: int
    shape: tuple[int, int]
    """``(out, in)``, as ``torch.nn.Linear.weight``."""
    mapped: np.ndarray
    """uint8 ``[rows, bytes]``: the rows as the file stores them (a view of its mapping), or
    a copy where only some of their columns were taken (``sharding.take_columns``)."""
    order: np.ndarray | None = None
    """Row ``i`` is ``mapped[order[i]]``; None: row ``i`` is ``mapped[i]``."""

    @property
    def rows(self) -> np.ndarray:
        """The rows in Hugging Face order: ``mapped`` itself, or a reordered copy (made at
        each call)."""
        return self.mapped if self.order is None else self.mapped[self.order]

    @property
    def nbytes(self) -> int:
        """Bytes of ``rows`` (without making them)."""
        return self.shape[0] * self.mapped.shape[1]

    @property
    def type_name(self) -> str:
        return GGUF_TYPES[self.qtype][0]

    def take_rows(self, start: int, stop: int) -> GGUFWeight:
        """Rows ``start:stop`` (output features), still in the mapping."""
        shape = (stop - start, self.shape[1])
        if self.order is None:
            return dataclasses.replace(self, shape=shape, mapped=self.mapped[start:stop])
        return dataclasses.replace(self, shape=shape, order=self.order[start:stop])

    def reorder(self, order: np.ndarray) -> GGUFWeight:
        """The weight whose row ``i`` is this one's row ``order[i]``."""
        return dataclasses.replace(self, order=order if self.order is None
                                   else self.order[order])

    def release(self) -> None:
        """Drop the file pages of ``mapped`` from this process (``madvise(MADV_DONTNEED)``)
        once the rows are laid out elsewhere: while a model is built, every page of the
        mapping it has read counts in its RSS, which on top of the arena took a 1B model's
        peak to the arena plus the whole file. The pages are the file's, unmodified: reading
        them again reads the file. Rows that are a copy have nothing to drop."""
        rows = self.mapped
        if rows.flags.owndata or rows.flags.writeable or rows.nbytes == 0:
            return
        start = rows.ctypes.data // PAGE * PAGE
        end = -(-(rows.ctypes.data + rows.nbytes) // PAGE) * PAGE
        madvise_dontneed(start, end - start)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]``, each value as gguf-py's ``dequantize`` gives it."""
        import torch
        from gguf.quants import dequantize

        from freetoken_core.kernels import cpu_kernels_available

        rows = torch.from_numpy(np.array(self.rows, dtype=np.uint8))  # a writable copy
        _, block, size = GGUF_TYPES[self.qtype]
        unit = 32 * size if block == 1 else size  # the native decoders' unit (gguf_types.h)
        if (cpu_kernels_available() and hasattr(torch.ops.freetoken, "gguf_dequantize")
                and rows.shape[1] % unit == 0):
            return torch.ops.freetoken.gguf_dequantize(rows, self.qtype, True)
        if self.qtype == 0:
            return rows.view(torch.float32).clone().reshape(self.shape)
        values = dequantize(self.rows.reshape(-1), self.qtype)
        return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(self.shape)


def check_tensors(reader: Any, path: Path) -> None:
    """Raise :class:`ModelLoadError` naming the first tensor whose type FreeToken does not
    compute with, whose row width is not a whole number of blocks, or whose bytes the file
    does not hold: before anything is allocated for the model. A split GGUF's shards are
    checked each against its own file."""
    for shard_path, shard in getattr(reader, "shards", [(path, reader)]):
        _check_file_tensors(shard, shard_path)


def _check_file_tensors(reader: Any, path: Path) -> None:
    """``check_tensors`` of one file (one shard of a split GGUF)."""
    from gguf import GGMLQuantizationType

    supported = ", ".join(name for name, _, _ in GGUF_TYPES.values())
    file_size = int(getattr(reader, "file_size", 0)) or path.stat().st_size
    start = int(getattr(reader, "data_start", 0))
    for t in reader.tensors:
        raw = int(t.tensor_type)
        dims = [int(d) for d in t.shape.tolist()]
        if raw not in GGUF_TYPES:
            try:
                type_name = GGMLQuantizationType(raw).name
            except ValueError:
                type_name = f"of ggml type id {raw}"
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} is {type_name}, which FreeToken does not compute with "
                f"(supported: {supported}); re-quantize the file to one of those types")
        name, block, size = GGUF_TYPES[raw]
        if dims[0] % block:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} ({name}) has rows of {dims[0]} values, not a whole "
                f"number of {block}-value blocks; the file is corrupt - re-download it")
        expected = int(np.prod(dims, dtype=np.int64)) // block * size
        if t.data is None or t.data.nbytes != expected:
            have = file_size - start - int(getattr(t, "offset", 0))
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} ({name}, shape {dims[::-1]}) needs {expected} bytes "
                f"but the file holds {max(min(have, expected), 0)} of them: {path} is "
                "truncated or corrupt - re-download it")


def read_gguf_weights(path: Path, reader: Any, arch: str, num_layers: int, num_heads: int,
                      num_kv_heads: int, tied: bool) -> dict[str, GGUFWeight | torch.Tensor]:
    """The weights of the ``arch`` GGUF file ``path`` (opened as ``reader``) under their
    Hugging Face names: 2-d weights as :class:`GGUFWeight`, 1-d ones (and 2-d norms: a
    weight a head, Command R+'s) as float32 tensors.

    Raises :class:`ModelLoadError` (naming the tensor) for an unsupported type, a size that
    disagrees with the type and shape, a tensor the family does not have, or a missing one.
    Llama files store q/k rows permuted for interleaved rotary pairs (llama.cpp's
    ``convert_hf_to_gguf.py``); they are put back in Hugging Face order here, as
    transformers' GGUF loader does. Gemma's converter (Gemma 2's and 3's) adds 1 to every
    norm weight; it is taken off again, as transformers' loader does, so the model computes
    ``1 + w``."""
    check_tensors(reader, path)
    heads = {f"{attn}.{p}_proj.weight": n for attn in ("self_attn", "mixer")  # (Nemotron-H's)
             for p, n in (("q", num_heads), ("k", num_kv_heads))}
    weights: dict[str, GGUFWeight | torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS.get(arch, ()):
            continue  # in the config's rope_scaling (gguf_metadata.rope_factor_scaling)
        name = hf_name(arch, t.name)
        if name is None:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} is not part of a {arch} model as FreeToken knows "
                "it; the file may be of a variant FreeToken does not run (e.g. shared "
                "experts)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = int(t.tensor_type)
        if len(shape) == 1:
            weights[name] = _vector(t, qtype, arch)
            continue
        # (a norm per head: Cohere's; ERNIE 4.5's selection bias, [1, experts])
        if len(shape) == 2 and name.endswith(("_norm.weight", "mlp.expert_bias")):
            weights[name] = GGUFWeight(t.name, qtype, (shape[0], shape[1]), np.asarray(
                t.data).view(np.uint8).reshape(shape[0], -1)).dequantize().clone()
            continue
        if len(shape) == 2 and "{e}" in name and name.endswith(".bias"):  # one per expert
            values = GGUFWeight(t.name, qtype, (shape[0], shape[1]),
                                np.asarray(t.data).view(np.uint8).reshape(shape[0], -1))
            for e, row in enumerate(values.dequantize()):
                weights[name.format(e=e)] = row.clone()
            continue
        if len(shape) == 3 and "{e}" in name:  # one 2-d weight per expert
            experts = np.asarray(t.data).view(np.uint8).reshape(shape[0], shape[1], -1)
            for e in range(shape[0]):
                weights[name.format(e=e)] = GGUFWeight(f"{t.name}[{e}]", qtype,
                                                       (shape[1], shape[2]), experts[e])
            continue
        if len(shape) != 2 or "{e}" in name:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has shape {list(shape)}; "
                                 f"FreeToken expects {3 if '{e}' in name else 2}-d weights")
        rows = np.asarray(t.data).view(np.uint8).reshape(shape[0], -1)
        tail = name.split(".", 3)[-1]
        order = (_reverse_permutation(shape[0], heads[tail], t.name)
                 if arch in PERMUTED_QK and tail in heads else None)
        weights[name] = GGUFWeight(t.name, qtype, (shape[0], shape[1]), rows, order)
    if arch in gguf_qwen35.EVERY_LAYER:
        weights = gguf_qwen35.hf_weights(reader, weights, num_layers)
    if arch == "granitehybrid":
        weights = hf_mamba2_weights(weights, "mamba")
    if arch in gguf_nemotron_h.ARCHITECTURES:
        weights = gguf_nemotron_h.hf_weights(weights, num_layers)
    if arch == "apertus":  # (xIELU's scalars, from the metadata)
        weights = gguf_apertus.hf_weights(reader, weights, num_layers)
    if arch == "falcon-h1":
        weights = gguf_falcon_h1.hf_weights(weights, tied)
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(weights)
    missing |= {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(num_layers)
                if not any(f"model.layers.{i}.{mixer}" in weights for mixer in MIXER_OUTPUTS)
                } - set(weights)
    if not tied:
        missing |= {"lm_head.weight"} - set(weights)
    if missing:
        raise ModelLoadError(
            f"GGUF file {path} lacks {len(missing)} tensors (e.g. {min(missing)}); the file is "
            "incomplete - re-download it")
    return weights


def _vector(t: Any, qtype: int, arch: str) -> torch.Tensor:
    """A 1-d tensor (norm or bias) as float32."""
    weight = GGUFWeight(t.name, qtype, (1, int(t.shape[0])),
                        np.asarray(t.data).view(np.uint8).reshape(1, -1))
    values = weight.dequantize().reshape(-1).clone()
    if arch in ("gemma2", "gemma3") and t.name.endswith("norm.weight"):
        values -= 1.0
    return values


def _reverse_permutation(n: int, n_head: int, name: str) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``
    ``permute``) of ``n`` rows, exactly as ``transformers.modeling_gguf_pytorch_utils.
    LlamaTensorProcessor`` does, on rows of blocks (a row is one output feature, so
    reordering rows reorders features)."""
    if n % (2 * n_head):
        raise ModelLoadError(
            f"GGUF tensor {name!r} has {n} rows, which do not split into {n_head} heads; the "
            "file's head counts are inconsistent - re-export the model")
    return np.arange(n).reshape(n_head, n // n_head // 2, 2).swapaxes(2, 1).reshape(-1)
