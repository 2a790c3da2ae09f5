"""EXAONE 3.0 and 3.5 (transformers' ``ExaoneForCausalLM``; GGUF ``exaone``): Llama's model
exactly, as transformers computes it (its ``ExaoneConfig`` is a ``LlamaConfig`` and the
class a ``LlamaForCausalLM``), under other names:

- config.json's ``num_layers``, ``layer_norm_epsilon`` and ``activation_function`` are
  ``num_hidden_layers``, ``rms_norm_eps`` and ``hidden_act`` (``ExaoneConfig.attribute_map``),
  and its defaults are EXAONE's (:func:`exaone_config`);
- the checkpoints' tensors are GPT-2's names (``transformer.h.{i}.attn.attention.q_proj``,
  ``mlp.c_fc_0`` ...), read as Llama's (:func:`exaone_weight_name`: transformers'
  ``conversion_mapping`` for ``exaone``, in its order).

llama.cpp's converter writes ``exaone`` files with Llama's tensor names, the q/k rows as
the checkpoint has them (half-offset rotary pairs, unlike its ``llama`` files) and the
Llama 3 rope scaling of EXAONE 3.5 as ``rope_freqs`` factors.
"""

from __future__ import annotations

import re
from typing import Any

from freetoken_core.models.config_defaults import with_defaults

# ExaoneConfig.attribute_map: the released config.json's key -> transformers' name.
_KEYS = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
         "activation_function": "hidden_act"}
# ExaoneConfig's defaults where config.json leaves a key out (and its ``default_theta``,
# 500,000), for the keys config.py reads with other defaults.
_DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1,
             "eos_token_id": 361}

_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.h\.", "model.layers."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"\.attn\.attention\.", ".self_attn."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.ln_1\.", ".input_layernorm."),
    (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
    (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
    (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
)]


def exaone_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (an ``ExaoneForCausalLM`` config.json) under transformers' key names, with
    ``ExaoneConfig``'s defaults where it leaves keys out (a transformers name wins over its
    alias where both are given)."""
    out = {_KEYS.get(key, key): value for key, value in cfg.items() if key in _KEYS}
    out.update({key: value for key, value in cfg.items() if key not in _KEYS})
    return with_defaults(out, _DEFAULTS, 500_000.0)


def exaone_weight_name(name: str) -> str:
    """A checkpoint's tensor ``name`` as Llama's (unchanged where it already is)."""
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name
