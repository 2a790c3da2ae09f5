"""Load a model into the native implementation: a Hugging Face directory's safetensors, or a
GGUF file read in place (``gguf_weights``)."""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_families import text_architecture
from freetoken_core.models.gguf_metadata import architecture
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_weights import GGUFWeight, read_gguf_weights
from freetoken_core.models.llama import LlamaForCausalLM
from freetoken_core.models.multimodal import released_experts, text_weight_name
from freetoken_core.models.mxfp4 import split_experts
from freetoken_core.models.registry import model_class
from freetoken_core.models.sharding import Shard
from freetoken_core.models.weight_names import weight_renamer


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}; FreeToken loads "
                             "safetensors checkpoints or .gguf files")
    return files


def read_weights(model_dir: Path, dtype: torch.dtype, device: torch.device,
                 rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """The safetensors of ``model_dir``, floating-point ones as ``dtype`` on ``device``;
    ``rename``: each tensor's name as the model knows it (None: not read)."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    key = rename(name) if rename is not None else name
                    if key is None:
                        continue
                    tensor = f.get_tensor(name)
                    # (integer tensors, gpt-oss's MXFP4 blocks and scales, stay as they are)
                    weights[key] = (tensor.to(device=device, dtype=dtype)
                                    if tensor.is_floating_point() else tensor)
        except (OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read weights {path}: {exc}") from exc
    return weights


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, gguf_path: Path | None = None,
               shard: Shard | None = None, overrides: dict[str, Any] | None = None
               ) -> LlamaForCausalLM:
    """The model described by ``model_dir``'s config.json, its weights from ``gguf_path``
    where given (the GGUF file, read in place: in float32 on CPU with the native kernels the
    linears keep its blocks; elsewhere each weight is dequantized to ``dtype`` as it is
    read), else from ``model_dir``'s safetensors. ``shard``: only this tensor-parallel
    rank's part of the weights is kept (``sharding``). ``overrides``: config.json keys
    replaced (``--hf-overrides``)."""
    cfg = ModelConfig.from_dir(model_dir, overrides)
    if gguf_path is None:
        rename = text_weight_name if cfg.text_of else weight_renamer(cfg.architecture)
        weights = read_weights(model_dir, dtype, device, rename)
        if cfg.text_of and cfg.num_experts:
            released_experts(weights, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.mxfp4_experts:
            split_experts(weights, cfg.num_layers, cfg.num_experts,
                          keeps_blocks(dtype, device), dtype, device)
    else:
        weights = gguf_weights(gguf_path, cfg, dtype, device)
    try:
        model = model_class(cfg)(cfg, weights, max_positions, shard)
    except KeyError as exc:
        source = gguf_path or model_dir
        raise ModelLoadError(f"checkpoint {source} lacks weight {exc}") from exc
    del weights
    return_freed_memory()  # the load's temporaries, which the heap would keep
    return model


def gguf_weights(gguf_path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
                 ) -> dict[str, object]:
    """The weights of ``gguf_path`` for the model ``cfg``: 2-d ones as ``GGUFWeight`` blocks
    in float32 on CPU with the native kernels, else dequantized to ``dtype`` on ``device``."""
    reader = open_header(gguf_path)
    weights: dict[str, object] = dict(read_gguf_weights(
        gguf_path, reader, text_architecture(architecture(reader)), cfg.num_layers, cfg.num_heads,
        cfg.num_kv_heads, cfg.tie_word_embeddings))
    keep_blocks = keeps_blocks(dtype, device)
    for name, w in weights.items():
        if isinstance(w, GGUFWeight):
            if not keep_blocks:
                weights[name] = w.dequantize().to(device=device, dtype=dtype)
        else:
            weights[name] = w.to(device=device, dtype=dtype)
    return weights


def keeps_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the linears compute from quantized blocks (``GGUFWeight``): in float32 on CPU
    with the native kernels; elsewhere the blocks are dequantized to ``dtype`` as read."""
    return dtype == torch.float32 and device.type == "cpu" and cpu_kernels_available()


def return_freed_memory() -> None:
    """Give the heap's free memory back to the kernel once (glibc ``malloc_trim``): the
    engine's allocator thresholds (engine/memory.py) would otherwise keep a load's
    temporaries resident for good (~220 MB for a 3B GGUF). Elsewhere nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
