"""Falcon-H1 GGUF files (``general.architecture`` ``falcon-h1``), as llama.cpp's converter writes
them (``conversion/falcon_h1.py`` ``FalconH1Model`` over ``Mamba2Model``) and its
``src/models/falcon-h1.cpp`` reads them: the metadata as the Hugging Face config keys
``config_falcon_h1`` reads, and the tensor names (the Mamba-2 tensors' changes undone as for
Granite 4's: ``gguf_mamba2.hf_mamba2_weights``).

Metadata (``falcon-h1.``): the mixer's shape from ``ssm.*`` (``gguf_mamba2.ssm_shape``;
``ssm.inner_size`` is ``mamba_d_ssm``); the attention's ``attention.head_count`` /
``head_count_kv`` / ``key_length``, the MLP's ``feed_forward_length``, ``rope.freq_base``
(the common keys). The chunk size and
``time_step_limit`` are not stored (transformers' defaults; the chunked scan is the
recurrence).

The converter multiplies every µP multiplier into the weights (the embeddings by
``embedding_multiplier``, ``output`` by ``lm_head_multiplier``, ``attn_q`` / ``attn_v`` by
``attention_in_multiplier``, ``attn_k`` by it and ``key_multiplier``, ``attn_output`` by
``attention_out_multiplier``, ``ssm_in`` by ``ssm_in_multiplier`` and its rows by
``ssm_multipliers``, ``ssm_out`` by ``ssm_out_multiplier``, ``ffn_gate`` / ``ffn_down`` by
``mlp_multipliers``), so a file's model has none (all 1), as llama.cpp computes it. A file
without ``output.weight`` (a tied checkpoint's) has lost ``lm_head_multiplier``: its logits are
llama.cpp's, ``embedding_multiplier / lm_head_multiplier`` times transformers' (a warning
says so). The mixer's gated norm is there where the file has ``ssm_norm`` (the checkpoint's
``mamba_rms_norm``), after the gate as llama.cpp computes it (``mamba_norm_before_gate``
false, as the released configs have it; the file does not say). No q/k permutation
(llama.cpp rotates Falcon-H1's halves, as transformers does). The MLP's norm is ``ffn_norm``,
without ``.weight`` (gguf-py maps the checkpoint's ``pre_ff_layernorm.weight`` whole, and
llama.cpp reads that name).
"""

from __future__ import annotations

import logging
from typing import Any

from freetoken_core.models import gguf_granite4
from freetoken_core.models.gguf_mamba2 import hf_mamba2_weights, ssm_shape

log = logging.getLogger(__name__)

P = "falcon-h1."
# A block's tensors, by their names under ``blk.{i}.`` (Llama's names: weight_names.py).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",  # (no ".weight": module docstring)
    **{k: v for k, v in gguf_granite4.LAYER_TENSORS.items() if k.startswith(("attn_", "ssm_"))},
    **{f"ffn_{p}.{kind}": f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down")
       for kind in ("weight", "bias")},
}
# The multipliers the converter folds into the weights (module docstring): 1 in the file.
_FOLDED = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0,
           "attention_in_multiplier": 1.0, "key_multiplier": 1.0,
           "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
           "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5,
           "mlp_multipliers": [1.0, 1.0]}


def falcon_h1_config(reader: Any, names: set[str]) -> dict[str, Any]:
    """The Hugging Face config keys (``FalconH1Config``'s) of a ``falcon-h1`` file whose
    tensors are ``names`` (module docstring), beyond the common ones."""
    ssm = ssm_shape(reader, P)
    return {"model_type": "falcon_h1", "mamba_n_heads": ssm.heads,
            "mamba_d_head": ssm.head_dim, "mamba_d_ssm": ssm.inner, "mamba_n_groups": ssm.groups,
            "mamba_d_state": ssm.state, "mamba_d_conv": ssm.conv,
            "mamba_rms_norm": "blk.0.ssm_norm.weight" in names,
            "mamba_norm_before_gate": False, **_FOLDED}


def hf_weights(weights: dict[str, Any], tied: bool) -> dict[str, Any]:
    """``weights`` (the file's, under the names of :data:`LAYER_TENSORS`) with the mixers'
    tensors as transformers' checkpoint holds them (``gguf_mamba2.hf_mamba2_weights``); a
    ``tied`` file (no ``output.weight``) warned about (module docstring)."""
    if tied:
        log.warning("this falcon-h1 GGUF has no output.weight (a tied checkpoint's): llama.cpp's "
                    "converter multiplied embedding_multiplier into token_embd and dropped "
                    "lm_head_multiplier, so the logits are llama.cpp's, not transformers' (the "
                    "same greedy tokens, another scale for sampling)")
    return hf_mamba2_weights(weights, "mamba")
