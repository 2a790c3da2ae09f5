"""The Mamba-2 mixers of llama.cpp's hybrid files (``granitehybrid``, ``falcon-h1``,
``nemotron_h``, ``nemotron_h_moe``), as its converter's ``Mamba2Model`` writes them and its
``build_mamba2_layer`` reads them: the shape from the ``ssm.*`` keys (:func:`ssm_shape`) and
the converter's changes to the small tensors undone (:func:`hf_mamba2_weights`).

Keys (under the architecture's prefix): ``ssm.time_step_rank`` the heads, ``ssm.inner_size``
their total size, ``ssm.group_count`` the groups of B / C (and of the gated norm),
``ssm.state_size``, ``ssm.conv_kernel``. The chunk size is not stored; the chunked scan is the
recurrence, so any chunk size computes the file's model.

Tensors: ``A_log`` is stored as ``ssm_a = -exp(A_log)`` ``[heads, 1]`` (``log(-ssm_a)``
here), ``D`` as ``ssm_d`` ``[heads, 1]``, ``dt_bias`` as ``ssm_dt.bias``, ``conv1d.weight``
``[channels, 1, kernel]`` squeezed to ``[channels, kernel]``, the gated norm's weight
reshaped to ``[groups, inner / groups]`` (flattened here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import require


@dataclass(frozen=True)
class SsmShape:
    """A file's Mamba-2 mixer shape (module docstring)."""

    heads: int
    head_dim: int
    inner: int
    """``heads * head_dim``."""
    groups: int
    state: int
    conv: int


def positive(reader: Any, key: str) -> int:
    """The file's ``key``, required, a positive integer."""
    value = require(reader, key)
    if not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ModelLoadError(f"GGUF {key} must be a positive integer, not {value!r}; "
                             "re-export the model with llama.cpp")
    return int(value)


def ssm_shape(reader: Any, prefix: str) -> SsmShape:
    """The ``{prefix}ssm.*`` keys (module docstring), each required and positive, the inner
    size whole heads and the heads whole groups."""
    heads = positive(reader, prefix + "ssm.time_step_rank")
    inner = positive(reader, prefix + "ssm.inner_size")
    groups = positive(reader, prefix + "ssm.group_count")
    if inner % heads or heads % groups:
        raise ModelLoadError(f"GGUF {prefix}ssm.inner_size {inner} must split into the {heads} "
                             f"Mamba heads ({prefix}ssm.time_step_rank), a multiple of the "
                             f"{groups} groups ({prefix}ssm.group_count)")
    return SsmShape(heads, inner // heads, inner, groups,
                    positive(reader, prefix + "ssm.state_size"),
                    positive(reader, prefix + "ssm.conv_kernel"))


def hf_mamba2_weights(weights: dict[str, Any], mixer: str) -> dict[str, Any]:
    """``weights`` (a file's, under Hugging Face names, each Mamba-2 mixer's under
    ``.{mixer}.``) with the mixers' small tensors as transformers' checkpoint holds them
    (module docstring): float32 tensors of transformers' shapes, ``A_log`` from ``ssm_a``."""
    import torch

    out: dict[str, Any] = {}
    marker = f".{mixer}."
    for name, w in weights.items():
        tail = name.rsplit(marker, 1)[-1] if marker in name else ""
        if tail in ("A_log", "D", "norm.weight", "conv1d.weight"):
            if not isinstance(w, torch.Tensor):
                w = w.dequantize()
            if tail != "conv1d.weight":
                w = w.reshape(-1)
            if tail == "A_log":
                if not bool(torch.all(w < 0)):
                    raise ModelLoadError(f"GGUF tensor {name} (ssm_a) holds values of 0 or "
                                         "above; llama.cpp stores -exp(A_log) there - "
                                         "re-export the model")
                w = torch.log(-w)
        out[name] = w
    return out
