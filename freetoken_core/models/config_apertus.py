"""Apertus's config.json (``ApertusForCausalLM``: Apertus 8B, 70B; and Apertus 1.5's text
model, ``Apertus1p5TextForCausalLM``) read as transformers' ``ApertusConfig`` /
``Apertus1p5TextConfig`` read it, under the keys ``config.ModelConfig.from_dict`` reads.

transformers' defaults where config.json leaves a key out (hidden 4096, 32 layers of 32
heads, ``xielu``, 65,536 positions, eps 1e-5, untied; Apertus 1.5's vocabulary 266,752).
The rope as ``ApertusConfig.__post_init__`` makes it: without ``rope_scaling`` /
``rope_parameters`` (or with them null) llama3 scaling of base 12,000,000 (factor 8 over
8,192 positions, frequency factors 1 and 4), the config's ``rope_theta`` not read; with
them their type, of their ``rope_theta``, else the config's, else 12,000,000. A rope type
FreeToken does not compute (``dynamic``, ``longrope``) is refused naming it, as is Apertus
1.5's pruned LM head (``output_vocab_size`` below ``vocab_size``: logits narrower than the
vocabulary)."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_fields import rope_kind

XIELU_PARAMETERS = ("alpha_p", "alpha_n", "beta", "eps")
"""The scalars of a layer's xIELU (``apertus.XIELU``), under ``model.layers.{i}.mlp.act_fn.``."""

_THETA = 12_000_000.0
_DEFAULTS = {"vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 14_336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "xielu",
             "max_position_embeddings": 65_536, "rms_norm_eps": 1e-5, "bos_token_id": 1,
             "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False}
_APERTUS1P5_VOCAB = 266_752  # (Apertus1p5TextConfig's: the text, visual and audio tokens)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
           "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# The rope types the common rope computes (``factors``: a GGUF file's ``rope_freqs``).
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "factors")


def apertus_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the config class's defaults and its rope (module docstring) as
    ``rope_theta`` and ``rope_scaling``."""
    arch = next(iter(cfg.get("architectures") or []), "ApertusForCausalLM")
    vocab = _APERTUS1P5_VOCAB if arch == "Apertus1p5TextForCausalLM" else _DEFAULTS["vocab_size"]
    out = {**_DEFAULTS, "vocab_size": vocab, **cfg}
    pruned = cfg.get("output_vocab_size")
    if pruned is not None and pruned != out["vocab_size"]:
        raise ModelLoadError(
            f"{arch} with output_vocab_size {pruned} (an LM head pruned to fewer rows than "
            f"the vocabulary of {out['vocab_size']}) is not supported; FreeToken serves "
            "Apertus 1.5 checkpoints whose head covers the whole vocabulary")
    scaling = cfg.get("rope_scaling")
    params = scaling if scaling else cfg.get("rope_parameters")
    if not isinstance(params, dict):  # (transformers: llama3 of base 12M, rope_theta unread)
        params, theta = _LLAMA3, _THETA
    else:
        theta = params.get("rope_theta") or cfg.get("rope_theta") or _THETA
    kind = rope_kind(params)
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(f"{arch} with rope_type {kind!r} is not supported; FreeToken "
                             f"computes {', '.join(_ROPE_TYPES[:-1])} for it")
    out.pop("rope_parameters", None)
    out["rope_scaling"] = {**params, "rope_type": kind, "rope_theta": float(theta)}
    out["rope_theta"] = float(theta)
    return out
