"""transformers' model of a GGUF file: the oracle the native model is compared with.

transformers' GGUF loader dequantizes every weight to float32 (gguf-py's ``dequantize``),
un-permutes llama's q/k rows and undoes Gemma's norm offset, independently of FreeToken's
reader. Loaded once per file and test session."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from freetoken_core.models.resolve import default_gguf_path


@functools.cache
def hf_from_gguf(path: Path | None = None) -> torch.nn.Module:
    """transformers' float32 model of ``path`` (the default model's file if ``None``)."""
    from transformers import AutoModelForCausalLM

    path = Path(path) if path is not None else default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()
