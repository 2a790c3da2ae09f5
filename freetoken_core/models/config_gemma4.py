"""Gemma 4's ``ModelConfig`` fields, read from its config.json as transformers'
``Gemma4TextConfig`` reads it (its defaults where a key is left out); a value FreeToken
cannot run is refused naming its key (``config.ModelConfig.from_dict`` calls
:func:`gemma4_fields`).

What Gemma 4's text model has beyond Gemma 3's (``models/gemma4.py`` computes each):

- ``layer_types`` (default: every 6th layer global, the last one always), the sliding layers
  over ``sliding_window`` keys;
- per layer, its heads' size and KV heads: the global layers' ``global_head_dim`` (512) and,
  where ``attention_k_eq_v``, ``num_global_key_value_heads``, whose values are the key
  projection's output (no v projection); a config saved by transformers holds these as
  ``per_layer_config`` (layer index -> ``head_dim`` / ``num_key_value_heads``);
- each layer type's rope: ``rope_parameters.sliding_attention`` (default, base 10,000) and
  ``full_attention`` (``proportional``: the first ``partial_rotary_factor`` of the pairs
  turn, at frequencies of the whole head's size, the others not; base 1,000,000);
- ``num_kv_shared_layers``: the last layers compute no keys or values and attend to those of
  the last earlier layer of their type;
- per-layer embeddings (``hidden_size_per_layer_input`` > 0: E2B, E4B);
- ``enable_moe_block``: every layer's dense MLP beside ``num_experts`` experts
  (``top_k_experts`` a token, ``moe_intermediate_size`` each: the 26B-A4B);
- the scores unscaled (``query_scale`` 1), the final logits' softcap where set.
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import layer_windows_from, rope_kind

ARCH = "Gemma4ForCausalLM"
_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
          "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                             "rope_theta": 1_000_000.0}}


# Gemma4TextConfig's defaults that differ from what config.py assumes for a key left out.
_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
             "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
             "hidden_size_per_layer_input": 256}


def gemma4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's config.json with ``Gemma4TextConfig``'s defaults where it leaves keys out."""
    return with_defaults(cfg, _DEFAULTS)


def gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked (``cfg`` with ``gemma4_config``'s
    defaults)."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError(f"{ARCH} with use_bidirectional_attention 'all' (an encoder) is "
                             "not supported: FreeToken generates text")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{ARCH} with attention_bias is not supported (Gemma 4's "
                             "checkpoints have none)")
    layers = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
    if types:
        types[-1] = "full_attention"  # (transformers forces it, with a warning)
    windows = layer_windows_from(ARCH, types, layers, cfg.get("sliding_window", 512))
    head_dim, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
    head_dims, layer_kv_heads = _per_layer_shapes(cfg, types, head_dim, kv_heads)
    ropes = {kind: {**_ROPES[kind], **((cfg.get("rope_parameters") or {}).get(kind) or {})}
             for kind in _ROPES}
    local, full = ropes["sliding_attention"], ropes["full_attention"]
    if rope_kind(local) != "default":
        raise ModelLoadError(f"{ARCH} rope_parameters.sliding_attention.rope_type "
                             f"{rope_kind(local)!r} is not supported (checkpoints: default)")
    if rope_kind(full) not in ("default", "proportional"):
        raise ModelLoadError(f"{ARCH} rope_parameters.full_attention.rope_type "
                             f"{rope_kind(full)!r} is not supported; FreeToken computes "
                             "default and proportional")
    # (a GGUF file's rope_freqs: llama.cpp's factors for the proportional rope)
    factors = cfg.get("rope_scaling")
    factors = factors if isinstance(factors, dict) and rope_kind(factors) == "factors" else None
    if factors is not None and rope_kind(full) != "default":
        raise ModelLoadError(f"{ARCH} with rope frequency factors and a {rope_kind(full)!r} "
                             "rope on its global layers: one or the other")
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < layers or shared and any(
            t not in types[:layers - shared] for t in types[layers - shared:]):
        raise ModelLoadError(f"{ARCH} num_kv_shared_layers {shared} must leave, before the "
                             "shared layers, a layer of each type they have")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    fields: dict[str, Any] = {
        "layer_windows": windows,
        "layer_head_dims": head_dims,
        "layer_kv_heads": layer_kv_heads,
        "values_from_keys": tuple(int(k_eq_v and t == "full_attention") for t in types),
        "kv_shared_layers": shared,
        "per_layer_input_size": int(cfg.get("hidden_size_per_layer_input") or 0),
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": (factors if factors is not None
                         else None if rope_kind(full) == "default"
                         else {"rope_type": "proportional", "factor": full.get("factor", 1.0),
                               "partial_rotary_factor": full.get("partial_rotary_factor",
                                                                 1.0)}),
        "rope_local_theta": float(local["rope_theta"]),
        "query_scale": 1.0,
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
    }
    if cfg.get("enable_moe_block"):
        experts, top_k, size = (cfg.get(k) for k in ("num_experts", "top_k_experts",
                                                     "moe_intermediate_size"))
        if not all(isinstance(v, int) and v > 0 for v in (experts, top_k, size)) or (
                top_k > experts):
            raise ModelLoadError(f"{ARCH} with enable_moe_block needs num_experts, "
                                 "top_k_experts (at most num_experts) and "
                                 f"moe_intermediate_size >= 1, not {experts!r}, {top_k!r}, "
                                 f"{size!r}")
        fields.update(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=size, expert_gating="gemma4")
    return fields


def _per_layer_shapes(cfg: dict[str, Any], types: list[str], head_dim: int, kv_heads: int
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head size and KV heads: ``per_layer_config``'s where config.json has it
    (transformers writes it), else the global layers' ``global_head_dim`` (512) and, where
    ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        full: dict[str, Any] = {"head_dim": cfg.get("global_head_dim") or 512}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(overrides, dict):
        raise ModelLoadError(f"{ARCH} per_layer_config must map layer indices to settings")
    by_layer: dict[int, dict[str, Any]] = {}
    for key, value in overrides.items():
        index = int(key) if str(key).isdigit() else -1
        if not 0 <= index < len(types) or not isinstance(value, dict):
            raise ModelLoadError(f"{ARCH} per_layer_config key {key!r}: expected a layer "
                                 f"index below {len(types)} mapping to settings")
        unknown = set(value) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ModelLoadError(f"{ARCH} per_layer_config[{key}] sets {sorted(unknown)}; "
                                 "FreeToken reads head_dim and num_key_value_heads there")
        by_layer[index] = value
    dims = tuple(by_layer.get(i, {}).get("head_dim", head_dim) for i in range(len(types)))
    heads = tuple(by_layer.get(i, {}).get("num_key_value_heads", kv_heads)
                  for i in range(len(types)))
    for name, values in (("head_dim", dims), ("num_key_value_heads", heads)):
        if not all(isinstance(v, int) and v > 0 and (name != "head_dim" or v % 2 == 0)
                   for v in values):
            raise ModelLoadError(f"{ARCH} {name} of each layer must be a positive "
                                 f"{'even ' if name == 'head_dim' else ''}integer: "
                                 f"{list(values)}")
    return dims, heads
