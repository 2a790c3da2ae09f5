"""Load a Hugging Face model directory into the native model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import read_gguf_blocks
from freetoken_core.models.llama import LlamaForCausalLM


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


def read_weights(model_dir: Path, dtype: torch.dtype, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read weights {path}: {exc}") from exc
    return weights


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, gguf_path: Path | None = None) -> LlamaForCausalLM:
    """The model of ``model_dir``; ``gguf_path``, the GGUF file it was converted from,
    also hands the model its quantized blocks (float32 on CPU only)."""
    cfg = ModelConfig.from_dir(model_dir)
    weights = read_weights(model_dir, dtype, device)
    blocks = None
    if gguf_path is not None and dtype == torch.float32 and device.type == "cpu":
        blocks = read_gguf_blocks(gguf_path)
    try:
        return LlamaForCausalLM(cfg, weights, max_positions, blocks)
    except KeyError as exc:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks weight {exc}") from exc
