"""gpt-oss's MXFP4 experts as OpenAI released them: a Hugging Face directory whose config.json
has ``quantization_config.quant_method`` ``mxfp4`` keeps each layer's experts as
``mlp.experts.gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales``.
``split_experts`` makes them per-expert GGUF MXFP4 weights (ggml type 39), which the native
kernels compute from as they do a gpt-oss GGUF file's experts (no float copy: 4.25 bits a
weight); where the kernels do not compute (another dtype or device) they are dequantized.

The two layouts hold the same numbers. A block of 32 weights is one E8M0 exponent byte ``e``
and 16 bytes of 4-bit E2M1 codes; a weight is ``FP4[code] * 2^(e - 127)`` (transformers'
``convert_moe_packed_tensors``) = ``kvalues[code] * 2^(e - 128)`` (ggml's doubled levels
and halved scale), so ``e`` is kept as it is. Only the codes' order differs: the checkpoint
packs weights ``2i`` and ``2i + 1`` into byte ``i`` (low nibble first), GGUF (Q4_0's order)
weights ``j`` and ``j + 16`` into byte ``j``. The gate and up projections are one tensor of
``2 x size`` rows, interleaved (gate rows even), as transformers' dequantized
``gate_up_proj``'s columns are."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_weights import GGUFWeight

MXFP4 = 39  # the ggml type


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """uint8 ``[rows, groups x 17]``: GGUF MXFP4 blocks (``e``, then 16 bytes of codes) of a
    checkpoint's ``blocks`` ``[rows, groups, 16]`` and ``scales`` ``[rows, groups]``. GGUF's
    byte ``2i`` holds weights ``2i`` and ``2i + 16``: the low nibbles of the checkpoint's
    bytes ``i`` and ``i + 8``; its byte ``2i + 1`` weights ``2i + 1`` and ``2i + 17``: their
    high nibbles."""
    first, second = blocks[..., :8], blocks[..., 8:]
    out = torch.empty(*blocks.shape[:-1], 17, dtype=torch.uint8)
    out[..., 0] = scales
    out[..., 1::2] = (first & 0x0F) | ((second & 0x0F) << 4)
    out[..., 2::2] = (first >> 4) | (second & 0xF0)
    return out.reshape(blocks.shape[0], -1).numpy()


def split_experts(weights: dict[str, Any], num_layers: int, num_experts: int,
                  keep_blocks: bool, dtype: torch.dtype, device: torch.device) -> None:
    """Each layer's MXFP4 experts in ``weights`` (by the checkpoint's names, ``*_blocks``
    and ``*_scales`` as uint8 tensors) replaced by per-expert weights named as the other
    MoE checkpoints name them (``mlp.experts.{e}.{gate,up,down}_proj.weight`` and
    ``.bias``, what ``moe._expert_weights`` reads): ``GGUFWeight`` MXFP4 blocks where
    ``keep_blocks`` (float32 on CPU with the native kernels), else the weights dequantized
    to ``dtype`` on ``device``. The biases (float) are split likewise."""
    for layer in range(num_layers):
        experts = f"model.layers.{layer}.mlp.experts."
        try:
            tensors = {name: weights.pop(experts + name) for name in (
                "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                "down_proj_blocks", "down_proj_scales", "down_proj_bias")}
        except KeyError as exc:
            raise ModelLoadError(f"the MXFP4 checkpoint lacks weight {exc} (config.json's "
                                 "quantization_config says its experts are MXFP4)") from exc
        gate_up, down = (_expert_blocks(experts + name, tensors[name + "_blocks"],
                                        tensors[name + "_scales"], num_experts)
                         for name in ("gate_up_proj", "down_proj"))
        for e in range(num_experts):
            rows = gate_up[e]
            parts = {"gate_proj": (rows[0::2], tensors["gate_up_proj_bias"][e][0::2]),
                     "up_proj": (rows[1::2], tensors["gate_up_proj_bias"][e][1::2]),
                     "down_proj": (down[e], tensors["down_proj_bias"][e])}
            for name, (blocks, bias) in parts.items():
                source = "gate_up_proj" if name != "down_proj" else "down_proj"
                weight = GGUFWeight(
                    f"{experts}{source}_blocks[{e}] ({name})", MXFP4,
                    (blocks.shape[0], blocks.shape[1] // 17 * 32),
                    np.ascontiguousarray(blocks))
                weights[f"{experts}{e}.{name}.weight"] = (
                    weight if keep_blocks else weight.dequantize().to(device=device,
                                                                       dtype=dtype))
                weights[f"{experts}{e}.{name}.bias"] = bias.to(device=device, dtype=dtype)


def _expert_blocks(name: str, blocks: torch.Tensor, scales: torch.Tensor, num_experts: int
                   ) -> np.ndarray:
    """uint8 ``[experts, rows, groups x 17]``: every expert's GGUF MXFP4 blocks of ``name``'s
    checkpoint ``blocks`` ``[experts, rows, groups, 16]`` and ``scales`` ``[experts, rows,
    groups]``, whose shapes are checked."""
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4
            or blocks.shape[0] != num_experts or blocks.shape[-1] != 16
            or tuple(scales.shape) != tuple(blocks.shape[:-1])):
        raise ModelLoadError(
            f"{name}_blocks {list(blocks.shape)} ({blocks.dtype}) and _scales "
            f"{list(scales.shape)} ({scales.dtype}) are not MXFP4 experts: expected uint8 "
            f"[{num_experts}, rows, groups, 16] and [{num_experts}, rows, groups]")
    experts, rows, groups, _ = blocks.shape
    return gguf_blocks(blocks.reshape(experts * rows, groups, 16),
                       scales.reshape(experts * rows, groups)).reshape(experts, rows, -1)
