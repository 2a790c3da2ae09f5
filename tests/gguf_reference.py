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


def hf_with_weights_of(path: Path, config_class: type, model_class: type,
                       **config: object) -> torch.nn.Module:
    """A transformers ``model_class`` of ``path``'s weights (a file written as ``llama``,
    which transformers' GGUF loader reads), its config ``config_class`` of the same shape
    with ``config`` added: the oracle for families whose GGUF files that loader does not
    read (SmolLM3, Granite), or whose keys it drops."""
    loaded = hf_from_gguf(path)
    c = loaded.config
    shape = {key: getattr(c, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings")}
    model = model_class(config_class(**shape, pad_token_id=0, **config)).float().eval()
    model.load_state_dict(loaded.state_dict())
    return model
