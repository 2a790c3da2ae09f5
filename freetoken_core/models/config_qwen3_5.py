"""Qwen3.5's ``ModelConfig`` fields (transformers' ``Qwen3_5TextConfig``; the language model of
``Qwen3_5ForConditionalGeneration``) and Qwen3.5-MoE's (``Qwen3_5MoeTextConfig``), read as
transformers reads them, its defaults where config.json leaves a key out; a value FreeToken
cannot run is refused naming its key.

- ``layer_types``: ``linear_attention`` (Gated DeltaNet, ``gated_deltanet``) or
  ``full_attention``; default every ``full_attention_interval``-th layer (4) full;
- the linear layers' ``linear_num_key_heads`` (16), ``linear_num_value_heads`` (32),
  ``linear_key_head_dim`` / ``linear_value_head_dim`` (128) and
  ``linear_conv_kernel_dim`` (4);
- the attention layers' heads of ``head_dim`` (256), q/k norms, an output gate, RoPE on the
  first ``partial_rotary_factor`` (0.25) of each head (``rope_parameters``; its multimodal
  sections give a text token one position in all of them: plain RoPE);
- Qwen3.5-MoE: every layer's MLP ``num_experts`` (256) experts of ``moe_intermediate_size``
  (512), ``num_experts_per_tok`` (8) a token by the softmax of the router's logits, the top
  k renormalized, beside a shared expert of ``shared_expert_intermediate_size`` (512) gated
  by a sigmoid (``moe.SparseMoE``, as Qwen2-MoE's);
- Qwen3-Next (``Qwen3NextConfig``): Qwen3.5-MoE with 512 experts, 10 a token, dense layers
  where ``mlp_only_layers`` / ``decoder_sparse_step`` say, and its linear attention's
  projections fused per key head (``gated_deltanet.unfuse_qwen3_next``).
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import rope_kind

ARCH = "Qwen3_5ForCausalLM"
# Qwen3_5TextConfig's defaults that differ from what config.py assumes for a key left out.
_DEFAULTS = {"vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288,
             "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
             "head_dim": 256, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False}
_LINEAR = (("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
           ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
           ("linear_conv_kernel_dim", 4))


# Qwen3_5MoeTextConfig's (it has no dense MLP: intermediate_size is the experts').
_MOE_DEFAULTS = {**_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40,
                 "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def qwen3_5_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's config.json with ``Qwen3_5TextConfig``'s defaults where it leaves keys out."""
    return with_defaults(cfg, _DEFAULTS, 10_000.0)


def qwen3_5_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's config.json with ``Qwen3_5MoeTextConfig``'s defaults."""
    out = with_defaults(cfg, _MOE_DEFAULTS, 10_000.0)
    out.setdefault("intermediate_size", out["moe_intermediate_size"])
    return out


# Qwen3NextConfig's.
_NEXT_DEFAULTS = {**_DEFAULTS, "vocab_size": 151_936, "hidden_size": 2048,
                  "intermediate_size": 5632, "num_hidden_layers": 48,
                  "num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def qwen3_next_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's config.json with ``Qwen3NextConfig``'s defaults."""
    return with_defaults(cfg, _NEXT_DEFAULTS, 10_000.0)


def qwen3_next_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's fields: Qwen3.5-MoE's, the top k renormalized where ``norm_topk_prob``
    (default on), dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say."""
    fields = qwen3_5_moe_fields(cfg, "Qwen3NextForCausalLM")
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    flags = tuple(int(i not in dense and (i + 1) % step == 0)
                  for i in range(cfg["num_hidden_layers"]))
    return {**fields, "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "moe_layers": flags if 0 in flags else ()}


def qwen3_5_moe_fields(cfg: dict[str, Any], arch: str = "Qwen3_5MoeForCausalLM"
                       ) -> dict[str, Any]:
    """Qwen3.5's fields and its experts' (module docstring), checked."""
    counts = {key: cfg[key] for key in ("num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size",
                                        "shared_expert_intermediate_size")}
    for key, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{arch} {key} must be a positive integer, not {value!r}")
    if counts["num_experts_per_tok"] > counts["num_experts"]:
        raise ModelLoadError(f"{arch} num_experts_per_tok {counts['num_experts_per_tok']} "
                             f"exceeds num_experts {counts['num_experts']}")
    return {**qwen3_5_fields(cfg), **counts, "norm_topk_prob": True}


def qwen3_5_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked."""
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelLoadError(f"{ARCH} layer_types {types!r}: expected {layers} of "
                             "'linear_attention' / 'full_attention'")
    shape = []
    for key, default in _LINEAR:
        value = cfg.get(key, default)
        if not isinstance(value, int) or value < (2 if key == "linear_conv_kernel_dim" else 1):
            raise ModelLoadError(f"{ARCH} {key} must be a positive integer (a kernel of at "
                                 f"least 2), not {value!r}")
        shape.append(value)
    if shape[1] % shape[0]:
        raise ModelLoadError(f"{ARCH} linear_num_value_heads {shape[1]} is not a multiple of "
                             f"linear_num_key_heads {shape[0]}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope_kind(rope) not in ("default", "mrope"):
        raise ModelLoadError(f"{ARCH} rope type {rope_kind(rope)!r} is not supported "
                             "(its checkpoints use the default rope)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rotated = int(cfg["head_dim"] * partial)
    if not 0 < rotated <= cfg["head_dim"] or rotated % 2:
        raise ModelLoadError(f"{ARCH} partial_rotary_factor {partial!r} rotates {rotated} of "
                             f"the {cfg['head_dim']} dimensions of a head; it must be an even "
                             "number above 0")
    return {"layer_kinds": tuple("attention" if t == "full_attention" else t for t in types),
            "linear_attention_shape": tuple(shape), "partial_rotary_factor": partial,
            # (FreeToken's key: a GGUF file's layout, gguf_qwen35.py)
            "linear_value_heads_tiled": bool(cfg.get("linear_value_heads_tiled", False)),
            "attention_output_gate": True, "rope_scaling": None}
