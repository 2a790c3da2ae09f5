"""The architecture facts of a model, read from a Hugging Face config.json: the Llama family,
Gemma 2, Gemma 3 (text), Phi-3, and the mixture-of-experts Qwen3-MoE, Qwen2-MoE, Mixtral and
gpt-oss."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_core.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}

# The MLP activation of the families that check it (transformers' ACT2FN names).
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh", "phi3": "silu",
                "qwen3_moe": "silu", "qwen2_moe": "silu", "mixtral": "silu"}


@dataclass(frozen=True)
class ModelConfig:
    """What the native model needs to build itself; frozen, validated on load."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    """The MLP's gate activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, the keys a query attends to, its own included (sliding-window attention),
    or ``None`` for all of them; empty: every layer attends to every key. (Mistral's
    ``sliding_window`` above is not applied: the engine caps the context to it instead.)"""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers (Gemma 3's ``rope_local_base_freq``; they get
    no ``rope_scaling``); ``None``: ``rope_theta`` everywhere."""
    query_scale: float | None = None
    """Attention's score scale; ``None``: ``head_dim ** -0.5``."""
    final_logit_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma's ``final_logit_softcapping``)."""
    attn_logit_softcap: float | None = None
    """Each attention score (scaled) becomes ``cap * tanh(score / cap)`` before the softmax
    (Gemma 2's ``attn_logit_softcapping``); ``None``: none."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's dimensions RoPE rotates (the first ones; Phi-3)."""
    embedding_multiplier: float = 1.0
    """The embeddings' multiplier (Granite's ``embedding_multiplier``)."""
    residual_multiplier: float = 1.0
    """Each block's attention and MLP outputs' multiplier before they join the residual
    stream (Granite's ``residual_multiplier``)."""
    logits_scaling: float = 1.0
    """The logits' divisor (Granite's ``logits_scaling``)."""
    no_rope_layers: tuple[int, ...] = ()
    """Per layer, 1 where RoPE rotates queries and keys, 0 where it does not (SmolLM3's
    NoPE layers, transformers' ``no_rope_layers``); empty: every layer rotates."""
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP (Qwen2/3-MoE, Mixtral); 0: a dense model."""
    num_experts_per_tok: int = 0
    """The experts each token's MLP output is the weighted sum of (the router's top k)."""
    moe_intermediate_size: int = 0
    """Each expert's hidden size (the dense layers' is ``intermediate_size``)."""
    norm_topk_prob: bool = True
    """The top k router probabilities rescaled to sum to 1 (Mixtral always; the Qwens'
    ``norm_topk_prob``)."""
    routed_scaling_factor: float = 1.0
    """The routing weights' multiplier (llama.cpp's ``expert_weights_scale``)."""
    shared_expert_intermediate_size: int = 0
    """The hidden size of the shared expert every token also goes through, its output
    gated by a sigmoid (Qwen2-MoE); 0: none."""
    moe_layers: tuple[int, ...] = ()
    """Per layer, 1 where the MLP is a mixture of experts, 0 where it is dense (Qwen3-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``); empty: every layer's is, where
    ``num_experts`` > 0."""
    expert_gating: str = "softmax"
    """How the router's logits weight the experts: ``softmax`` (the softmax of all of them,
    then the top k) or ``softmax_weight`` (the top k logits, then their softmax: gpt-oss;
    llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``)."""
    expert_bias: bool = False
    """The router and each expert's linears have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the experts: the gate clamped to at most the limit, the up
    projection to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)``;
    ``None``: plain SwiGLU."""
    swiglu_alpha: float = 1.0
    """The sigmoid's slope of that SwiGLU (gpt-oss: 1.702)."""
    attention_sinks: bool = False
    """Each attention head has a learned sink logit in its softmax (gpt-oss's
    ``self_attn.sinks``)."""

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (not self.moe_layers or bool(self.moe_layers[index]))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; FreeToken runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else dict(rope_scaling, rope_type=kind)
            if kind == "yarn" and not rope_scaling.get("original_max_position_embeddings"):
                # transformers' default: the model's own length is the original one
                original = cfg.get("original_max_position_embeddings",
                                   cfg.get("max_position_embeddings"))
                if not original:
                    raise ModelLoadError("rope_scaling yarn needs original_max_position_"
                                         "embeddings (or max_position_embeddings) in "
                                         "config.json")
                rope_scaling["original_max_position_embeddings"] = original
        use_window = cfg.get("use_sliding_window", family in ("mistral", "mixtral"))
        # transformers' Gemma reads hidden_activation (default gelu_pytorch_tanh) only.
        hidden_act = ((cfg.get("hidden_activation") or "gelu_pytorch_tanh")
                      if family in ("gemma2", "gemma3") else (cfg.get("hidden_act") or "silu"))
        expected = _ACTIVATIONS.get(family)
        if expected is not None and hidden_act != expected:
            raise ModelLoadError(f"{arch} with hidden activation {hidden_act!r} is not "
                                 f"supported; FreeToken computes {expected} for it")
        fields: dict[str, Any] = {
            "rope_theta": float(rope_theta or 10000.0),
            "rope_scaling": rope_scaling,
            # (transformers' default where config.json leaves it out: tied for these two)
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings",
                                                family in ("gemma2", "gemma3",
                                                           "smollm3"))),
            "hidden_act": hidden_act,
        }
        if family == "gemma3":
            fields.update(_gemma3_fields(cfg))
        elif family == "gemma2":
            fields.update(_gemma2_fields(cfg))
        elif family == "phi3":
            fields.update(_phi3_fields(cfg, rope_scaling))
        elif family == "smollm3":
            fields.update(_smollm3_fields(cfg))
        elif family == "granite":
            fields.update(_granite_fields(cfg))
        elif family in ("qwen3_moe", "qwen2_moe", "mixtral"):
            fields.update(_moe_fields(cfg, arch, family))
        elif family == "gpt_oss":
            fields.update(_gpt_oss_fields(cfg, rope_scaling))
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            attention_bias=(family == "qwen2" or bool(cfg.get("attention_bias",
                                                               family == "gpt_oss"))
                            or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            sliding_window=cfg.get("sliding_window") if use_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **fields,
        )

    @classmethod
    def from_dir(cls, model_dir: Path, overrides: dict[str, Any] | None = None
                 ) -> ModelConfig:
        """``model_dir``'s config.json, its keys replaced by ``overrides``' (``--hf-overrides``)."""
        path = Path(model_dir) / "config.json"
        try:
            data = json.loads(path.read_text())
            if overrides:
                if not isinstance(data, dict):
                    raise ModelLoadError(f"{path} is not a JSON object")
                data = {**data, **overrides}
            return cls.from_dict(data)
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}; expected a Hugging Face "
                                 "config.json of a Llama-family model") from exc


def _rope_kind(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields, read as transformers' ``Gemma3TextConfig`` reads them: the rope of
    each layer type (``rope_parameters`` per type, or the legacy ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` keys, which apply to the global layers),
    ``layer_types`` (or every ``sliding_window_pattern``-th layer global), the query scale,
    the logits' softcap where set."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"Gemma3ForCausalLM with attn_logit_softcapping={cfg['attn_logit_softcapping']} is "
            "not supported (transformers' Gemma 3 attention ignores it, llama.cpp's converter "
            "refuses it; Gemma 3 checkpoints have it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma3ForCausalLM with use_bidirectional_attention (an encoder, "
                             "e.g. EmbeddingGemma) is not supported: FreeToken generates text")
    params = cfg.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict(params.get("full_attention") or {}) if nested else dict(params)
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    if _rope_kind(local) != "default":
        raise ModelLoadError(f"Gemma3ForCausalLM with rope type {_rope_kind(local)!r} on its "
                             "sliding-window layers is not supported (checkpoints use default)")
    kind = _rope_kind(full)
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = cfg.get("sliding_window_pattern") or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    return {
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": None if kind == "default" else dict(full, rope_type=kind),
        "rope_local_theta": float(local["rope_theta"]),
        "layer_windows": _layer_windows("Gemma3ForCausalLM", layer_types, num_layers,
                                        cfg.get("sliding_window")),
        "query_scale": cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        "final_logit_softcap": _softcap("Gemma3ForCausalLM", cfg, "final_logit_softcapping",
                                        None),
    }


def _gemma2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields as transformers' ``Gemma2Config`` reads them (its defaults where
    config.json leaves a key out): the scores softcapped at ``attn_logit_softcapping`` (50)
    and the logits at ``final_logit_softcapping`` (30), either off where null; the query
    scaled by ``query_pre_attn_scalar ** -0.5`` (256); ``layer_types`` (default: every
    other layer, the first included, sliding over ``sliding_window`` keys, 4096). One rope,
    ``rope_theta`` with ``rope_scaling``, on every layer (the common keys)."""
    arch, layers = "Gemma2ForCausalLM", cfg["num_hidden_layers"]
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{arch} with use_bidirectional_attention (an encoder) is not "
                             "supported: FreeToken generates text")
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if _positive(scalar) is None:
        raise ModelLoadError(f"{arch} query_pre_attn_scalar must be a positive number, "
                             f"not {scalar!r}")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return {"query_scale": scalar ** -0.5,
            "attn_logit_softcap": _softcap(arch, cfg, "attn_logit_softcapping", 50.0),
            "final_logit_softcap": _softcap(arch, cfg, "final_logit_softcapping", 30.0),
            "layer_windows": _layer_windows(arch, layer_types, layers,
                                            cfg.get("sliding_window", 4096))}


def _positive(value: Any) -> float | None:
    """``value`` as a float where it is a finite positive number, else ``None``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and (
            math.isfinite(value) and value > 0):
        return float(value)
    return None


def _softcap(arch: str, cfg: dict[str, Any], key: str, default: float | None
             ) -> float | None:
    """A softcap ``key`` (``default`` where config.json leaves it out): a positive number,
    or null for none."""
    value = cfg.get(key, default)
    if value is not None and _positive(value) is None:
        raise ModelLoadError(f"{arch} {key} must be a positive number or null (none), "
                             f"not {value!r}")
    return _positive(value)


def _layer_windows(arch: str, layer_types: list[str], num_layers: int, window: Any
                   ) -> tuple[int | None, ...]:
    """Each layer's window from ``layer_types`` (``sliding_attention`` layers attend to
    their last ``window`` keys, ``full_attention`` ones to all), checked: one type a layer,
    and a window of at least one key where a layer slides."""
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention",
                                                             "full_attention"}:
        raise ModelLoadError(f"{arch} layer_types {layer_types!r}: expected {num_layers} of "
                             "'sliding_attention' / 'full_attention'")
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{arch} with sliding-window layers needs sliding_window >= 1, "
                             f"not {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _expert_counts(arch: str, counts: tuple[tuple[str, Any, int], ...], top_k: int,
                   experts: int) -> None:
    """Each ``(key, value, least)`` an integer of at least ``least``, and no more experts a
    token than there are."""
    for key, value, low in counts:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ModelLoadError(f"{arch} {key} must be an integer >= {low}, not {value!r}")
    if top_k > experts:
        raise ModelLoadError(f"{arch} num_experts_per_tok {top_k} exceeds its {experts} "
                             "experts")


def _granite_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers, transformers' ``GraniteConfig`` defaults (1) where
    config.json leaves them out: the embeddings', the residual branches', the attention
    scores' (in place of ``head_dim ** -0.5``) and the logits' divisor."""
    def number(key: str) -> float:
        value = cfg.get(key, 1.0)
        if not isinstance(value, int | float) or not math.isfinite(value) or value == 0:
            raise ModelLoadError(f"GraniteForCausalLM {key} must be a finite non-zero "
                                 f"number, not {value!r}")
        return float(value)

    return {"embedding_multiplier": number("embedding_multiplier"),
            "residual_multiplier": number("residual_multiplier"),
            "query_scale": number("attention_multiplier"),
            "logits_scaling": number("logits_scaling")}


def _moe_fields(cfg: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
    """The mixture of experts as transformers' configs read it: Qwen3-MoE's (and Qwen2-MoE's,
    with its shared expert of ``shared_expert_intermediate_size``)
    ``num_experts`` (``num_local_experts`` as transformers 5 saves it),
    ``moe_intermediate_size``, ``norm_topk_prob`` (default False) and its dense layers
    (``mlp_only_layers``, and every layer but each ``decoder_sparse_step``-th); Mixtral's
    ``num_local_experts`` of ``intermediate_size``, every layer sparse, top k always
    renormalized. Both: ``num_experts_per_tok`` of them, softmax routing, SwiGLU experts.
    A key config.json leaves out takes transformers' default; a bad value is named."""
    layers = cfg["num_hidden_layers"]
    qwen = family in ("qwen3_moe", "qwen2_moe")
    qwen2 = family == "qwen2_moe"
    # (transformers' defaults where config.json leaves a key out)
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if qwen2 else 128)) if (
        qwen) else cfg.get("num_local_experts", 8)
    top_k = cfg.get("num_experts_per_tok", (4 if qwen2 else 8) if qwen else 2)
    size = cfg.get("moe_intermediate_size", 1408 if qwen2 else 768) if qwen else cfg.get(
        "intermediate_size")
    shared = cfg.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
    _expert_counts(arch, (("num_experts" if qwen else "num_local_experts", experts, 1),
                          ("num_experts_per_tok", top_k, 1),
                          ("moe_intermediate_size" if qwen else "intermediate_size", size, 1),
                          ("shared_expert_intermediate_size", shared, 0)), top_k, experts)
    scale = cfg.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ModelLoadError(f"{arch} routed_scaling_factor must be a positive number, "
                             f"not {scale!r}")
    flags: tuple[int, ...] = ()
    if qwen:
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        flags = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if qwen else True,
            "routed_scaling_factor": float(scale),
            "shared_expert_intermediate_size": shared,
            "moe_layers": flags if 0 in flags else ()}


def _gpt_oss_fields(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None
                    ) -> dict[str, Any]:
    """gpt-oss's fields as transformers' ``GptOssConfig`` reads them (its defaults where
    config.json leaves a key out): ``num_local_experts`` experts of ``intermediate_size``,
    ``num_experts_per_tok`` of them weighted by the softmax of their router logits (the
    router and the experts with biases), the clamped SwiGLU (``swiglu_limit``,
    ``swiglu_alpha``), a sink per attention head, and ``layer_types``: sliding-window
    layers attend to their last ``sliding_window`` keys (default: alternating, the first
    sliding). The rope is YaRN's (``rope_scaling`` / ``rope_parameters``)."""
    arch, layers = "GptOssForCausalLM", cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts", 128)
    top_k = cfg.get("num_experts_per_tok", 4)
    size = cfg.get("intermediate_size", 2880)
    _expert_counts(arch, (("num_local_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                          ("intermediate_size", size, 1)), top_k, experts)
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{arch} {key} must be a positive number, not {value!r}")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if rope_scaling is not None and rope_scaling["rope_type"] != "yarn":
        raise ModelLoadError(f"{arch} with rope type {rope_scaling['rope_type']!r} is not "
                             "supported (its checkpoints use yarn)")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size, "expert_gating": "softmax_weight",
            "expert_bias": True, "swiglu_limit": float(limit), "swiglu_alpha": float(alpha),
            "attention_sinks": True,
            "layer_windows": _layer_windows(arch, layer_types, layers,
                                            cfg.get("sliding_window", 128))}


def _smollm3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's NoPE layers as transformers' ``SmolLM3Config`` reads them: ``no_rope_layers``
    (1 rotates), else every ``no_rope_layer_interval``-th layer (default 4) without RoPE.
    Its optional sliding window is refused (the released models have none)."""
    layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"SmolLM3ForCausalLM no_rope_layers must hold 0 or 1 for each "
                             f"of the {layers} layers, not {flags!r}")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("SmolLM3ForCausalLM with use_sliding_window is not supported "
                             "(the released SmolLM3 models attend to every key)")
    return {"no_rope_layers": tuple(int(f) for f in flags)}


def _phi3_fields(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's fields: LongRoPE (``su`` and ``yarn`` are its old names, as transformers has
    them) with the pre-training length, the rotated fraction of each head, and the sliding
    window, which transformers applies to every layer (llama.cpp ignores it)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    fields: dict[str, Any] = {"partial_rotary_factor": float(factor)}
    if rope_scaling is not None:
        kind = rope_scaling["rope_type"]
        kind = "longrope" if kind in ("su", "yarn") else kind
        if kind != "longrope":
            raise ModelLoadError(f"Phi3ForCausalLM with rope_scaling type {kind!r} is not "
                                 "supported (transformers' Phi-3 knows default and longrope)")
        original = cfg.get("original_max_position_embeddings",
                           rope_scaling.get("original_max_position_embeddings"))
        if original is None:
            raise ModelLoadError("Phi3ForCausalLM longrope needs "
                                 "original_max_position_embeddings in config.json")
        fields["rope_scaling"] = dict(rope_scaling, rope_type=kind,
                                      original_max_position_embeddings=original)
    window = cfg.get("sliding_window")
    if window is not None:
        if window < 1:
            raise ModelLoadError(f"Phi3ForCausalLM sliding_window {window}: must be >= 1")
        fields["layer_windows"] = (window,) * cfg["num_hidden_layers"]
    return fields
