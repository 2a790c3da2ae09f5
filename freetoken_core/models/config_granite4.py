"""Granite 4's ``ModelConfig`` fields (transformers' ``GraniteMoeHybridConfig``), read as
transformers reads them, its defaults where config.json leaves a key out; a value FreeToken
cannot run is refused naming its key:

- ``layer_types`` (or ``layers_block_type``): ``mamba`` (``linear_attention``) or
  ``attention`` (``full_attention``) a layer, default every layer Mamba-2;
- the Mamba-2 layers' ``mamba_n_heads`` (128) of ``mamba_d_head`` (``auto``:
  ``mamba_expand`` (2) x hidden over the heads), ``mamba_n_groups`` (1), ``mamba_d_state``
  (256), ``mamba_d_conv`` (4), ``mamba_chunk_size`` (256), ``time_step_limit``;
- RoPE where ``position_embedding_type`` is ``rope``, else none (NoPE);
- Granite's four multipliers (``config_fields.granite_fields``);
- ``num_local_experts`` (8; 0: no experts) of ``intermediate_size``, ``num_experts_per_tok``
  (2), weighted by the softmax of their top router logits, beside the shared MLP of
  ``shared_intermediate_size`` (1024) every layer has.
"""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import granite_fields

ARCH = "GraniteMoeHybridForCausalLM"
_DEFAULTS = {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1,
             "eos_token_id": 2}
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
          "full_attention": "attention"}


def granite4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4's config.json with ``GraniteMoeHybridConfig``'s defaults."""
    return with_defaults(cfg, _DEFAULTS, 10_000.0)


def granite4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    if len(types) != layers or set(types) - set(_KINDS):
        raise ModelLoadError(f"{ARCH} layer_types {types!r}: expected {layers} of 'mamba' / "
                             "'attention'")
    shape = mamba_shape(ARCH, cfg, cfg.get("mamba_expand", 2) * hidden, "mamba_expand x hidden")

    experts = cfg.get("num_local_experts", 8) or 0
    fields: dict[str, Any] = {
        **granite_fields(cfg, ARCH),
        "layer_kinds": tuple(_KINDS[t] for t in types), "mamba_shape": shape,
        "mamba_time_step_limit": time_step_limit(ARCH, cfg),
        "no_rope_layers": () if cfg.get("position_embedding_type") == "rope" else
        (0,) * layers}
    if experts:
        top_k = cfg.get("num_experts_per_tok", 2)
        if not isinstance(top_k, int) or not 1 <= top_k <= experts:
            raise ModelLoadError(f"{ARCH} num_experts_per_tok must be 1 to num_local_experts "
                                 f"({experts}), not {top_k!r}")
        fields.update(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=cfg["intermediate_size"],
                      expert_gating="softmax_weight")
    return fields


def mamba_shape(arch: str, cfg: dict[str, Any], inner: Any, inner_name: str
                ) -> tuple[int, int, int, int, int, int]:
    """A Mamba-2 mixer's ``(heads, head size, groups, state size, conv kernel, chunk size)``
    from the ``mamba_*`` keys (transformers' defaults; ``mamba_d_head`` ``auto``: ``inner``
    over the heads), each a positive integer, the heads ``inner`` wide together (its name
    in an error: ``inner_name``) and a multiple of the groups."""
    heads = cfg.get("mamba_n_heads", 128)
    head_size = cfg.get("mamba_d_head", "auto")
    if head_size == "auto" and isinstance(heads, int) and heads > 0 and isinstance(inner, int):
        head_size = inner // heads
    shape = (heads, head_size, cfg.get("mamba_n_groups", 1), cfg.get("mamba_d_state", 256),
             cfg.get("mamba_d_conv", 4), cfg.get("mamba_chunk_size", 256))
    names = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
             "mamba_d_conv", "mamba_chunk_size")
    for name, value in zip(names, shape):
        if isinstance(value, bool) or not isinstance(value, int) or value < (
                2 if name == "mamba_d_conv" else 1):
            raise ModelLoadError(f"{arch} {name} must be a positive integer, not {value!r}")
    if heads * head_size != inner or heads % shape[2]:
        raise ModelLoadError(f"{arch} mamba_n_heads {heads} x mamba_d_head {head_size} must be "
                             f"{inner_name} ({inner}), and a multiple of mamba_n_groups")
    return shape


def time_step_limit(arch: str, cfg: dict[str, Any]) -> tuple[float, float]:
    """A Mamba-2 model's ``time_step_limit`` (default no bound): two numbers, low then
    high."""
    limit = [_number(v) for v in cfg.get("time_step_limit") or (0.0, math.inf)]
    if len(limit) != 2 or limit[0] is None or limit[1] is None or limit[0] > limit[1]:
        raise ModelLoadError(f"{arch} time_step_limit must be two numbers, low and high, not "
                             f"{cfg.get('time_step_limit')!r}")
    return limit[0], limit[1]


def _number(value: Any) -> float | None:
    """A number of config.json, infinities as transformers writes them
    (``{"__float__": "Infinity"}``); None for anything else."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
