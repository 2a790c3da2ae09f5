"""The architecture facts of a model, read from a Hugging Face config.json: every family of
:data:`SUPPORTED_ARCHITECTURES` (Llama and the families that change it, the mixture-of-experts
ones), and a vision-language checkpoint's language model (``models/multimodal.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.cohere_config import cohere_fields
from freetoken_core.models.config_falcon_h1 import HybridMultipliers
from freetoken_core.models.config_families import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    FIELDS,
    PREPARED,
    ROPE_FIELDS,
)
from freetoken_core.models.config_fields import granite_fields
from freetoken_core.models.config_moe import moe_fields, quantized_experts
from freetoken_core.models.multimodal import WRAPPERS, text_config, with_overrides, wrapper_of

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Dots1ForCausalLM": "dots1",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "FalconH1ForCausalLM": "falcon_h1",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma3nForCausalLM": "gemma3n",
    "Phi3ForCausalLM": "phi3",
    "PhiForCausalLM": "phi",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4ForCausalLM": "glm4",
    "Ministral3ForCausalLM": "ministral3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "ExaoneForCausalLM": "exaone",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "SeedOssForCausalLM": "seed_oss",
    "ArceeForCausalLM": "arcee",
    "Starcoder2ForCausalLM": "starcoder2",
    "OlmoeForCausalLM": "olmoe",
    "HunYuanDenseV1ForCausalLM": "hunyuan_dense",
    "HunYuanMoEV1ForCausalLM": "hunyuan_moe",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "ApertusForCausalLM": "apertus",
    "Apertus1p5TextForCausalLM": "apertus",  # (Apertus's model: config_apertus.py)
    "Llama4ForCausalLM": "llama4",
}

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
    layer_chunks: tuple[int, ...] = ()
    """Per layer, the chunk of positions its queries attend within (Llama 4's chunked
    attention: a query at position p attends to the keys from ``p // chunk * chunk`` to p),
    0 where it attends to every key; empty: no layer is chunked."""
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
    qk_norm_after_rope: bool = False
    """The q/k norms apply to the rotated queries and keys (Hunyuan's), not before the
    rotation."""
    gated_mlp: bool = True
    """The MLP is ``down(act(gate(x)) * up(x))`` (SwiGLU, Gemma's GeGLU); ``False``:
    ``down(act(up(x)))`` (Arcee's ReLU², ``hidden_act`` ``relu2``), no gate projection."""
    logit_scale: float = 1.0
    """The logits' multiplier (Cohere's ``logit_scale``)."""
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
    llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``); ``sigmoid`` (each logit's
    sigmoid, LFM2-MoE's); ``gemma4``: Gemma 4's router (gemma4.py)."""
    expert_selection_bias: bool = False
    """A per-expert bias added to the router's scores to choose the experts, not to weight
    them (LFM2-MoE's ``use_expert_bias``: ``mlp.expert_bias``)."""
    expert_groups: tuple[int, ...] = ()
    """``(n_group, topk_group)``: the experts in ``n_group`` groups, a token's chosen among
    its best ``topk_group`` groups' (GLM-4.5's); empty: no groups."""
    expert_group_by_max: bool = False
    """A group's score is its best expert's (DeepSeek-V2's ``group_limited_greedy``), not
    the sum of its two best."""
    expert_norm_eps: float = 0.0
    """Added to the chosen weights' sum before they are rescaled by it (LFM2-MoE: 1e-6)."""
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
    attention_temperature_beta: float = 0.0
    """Llama 4's attention temperature (Ministral 3's ``llama_4_scaling_beta``): each
    rotated query times ``1 + beta ln(1 + floor(position / length))``; 0: none. (Llama 4's
    own, ``attn_scale``: on its NoPE layers only, of ``position + 1``: llama4.py.)"""
    attention_temperature_length: int = 0
    """The length of that temperature's steps (``original_max_position_embeddings``; Llama
    4's ``floor_scale``)."""
    mxfp4_experts: bool = False
    """The experts' weights are MXFP4 blocks (``*_blocks`` / ``*_scales``: gpt-oss as OpenAI
    released it, ``quantization_config.quant_method`` ``mxfp4``; ``models/mxfp4.py``)."""

    layer_head_dims: tuple[int, ...] = ()
    """Per layer, its heads' size where the layers' differ (Gemma 4's global layers'
    ``global_head_dim``); empty: ``head_dim`` everywhere (``kv_layout``)."""
    layer_kv_heads: tuple[int, ...] = ()
    """Per layer, its KV heads where the layers' differ (Gemma 4's global layers'
    ``num_global_key_value_heads``); empty: ``num_kv_heads`` everywhere."""
    values_from_keys: tuple[int, ...] = ()
    """Per layer, 1 where the values are the key projection's output, before the key norm
    and the rotation (no v projection: Gemma 4's ``attention_k_eq_v`` global layers)."""
    kv_shared_layers: int = 0
    """The last this many layers compute no keys or values: each attends to those of the
    last earlier layer of its type, sliding or global (Gemma 4's ``num_kv_shared_layers``)."""
    per_layer_input_size: int = 0
    """Gemma 4's per-layer embeddings (``hidden_size_per_layer_input``): each layer's input
    of this size from a second embedding of the token and a projection of the first; 0:
    none."""
    per_layer_vocab_size: int = 0
    """The tokens with a row of the per-layer embedding (Gemma 3n's
    ``vocab_size_per_layer_input``): a token id past them takes token 0's row; 0: every
    token has its own (Gemma 4's)."""
    altup: tuple[int, ...] = ()
    """Gemma 3n's AltUp: ``(copies of the hidden state, the copy the layers compute on, 1
    where its correction is scaled by the layer's correct_output_scale)`` (``gemma3n``);
    empty: one hidden state."""
    laurel_rank: int = 0
    """The rank of Gemma 3n's LAuReL branch beside attention (``laurel_rank``); 0: none."""
    activation_sparsity: tuple[float, ...] = ()
    """Per layer, Gemma 3n's activation sparsity: where > 0, the MLP's gate keeps only what
    exceeds its mean plus ``icdf(sparsity)`` standard deviations (a Gaussian top-k);
    empty: none."""
    layer_intermediate_sizes: tuple[int, ...] = ()
    """Per layer, its MLP's hidden size where the layers' differ (Gemma 3n's
    ``intermediate_size`` list); empty: ``intermediate_size`` everywhere."""

    layer_kinds: tuple[str, ...] = ()
    """Per layer, ``attention``, ``linear_attention`` (Qwen3.5's Gated DeltaNet layers: a
    recurrent state per sequence instead of keys and values, ``gated_deltanet``),
    ``short_conv`` (LFM2's, ``short_conv``), ``mamba`` (Granite 4's Mamba-2, ``mamba2``) or
    ``hybrid`` (Falcon-H1's attention and Mamba-2 side by side: keys and values and a state);
    empty: every layer attention."""
    linear_attention_shape: tuple[int, ...] = ()
    """The linear-attention layers' ``(key heads, value heads, key head size, value head
    size, convolution kernel)``."""
    mamba_shape: tuple[int, ...] = ()
    """Granite 4's ``mamba`` layers' ``(heads, head size, groups, state size, conv kernel,
    chunk size)`` (``mamba2``)."""
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))
    """The bounds of a Mamba-2 layer's time step (``time_step_limit``)."""
    mamba_norm: str = "after_gate"
    """A Mamba-2 mixer's output ``y`` and gate ``z``: ``after_gate``, ``norm(y silu(z))``
    (Granite 4's, Nemotron-H's); ``before_gate``, ``norm(y) silu(z)``; ``none``,
    ``y silu(z)`` (Falcon-H1's ``mamba_rms_norm`` / ``mamba_norm_before_gate``)."""
    hybrid_multipliers: HybridMultipliers | None = None
    """Falcon-H1's µP multipliers of its blocks (``config_falcon_h1``)."""
    short_conv_kernel: int = 0
    """LFM2's ``conv`` layers' kernel (``conv_L_cache``): each keeps a sequence's last
    ``kernel - 1`` inputs (``short_conv``)."""
    linear_value_heads_tiled: bool = False
    """The linear-attention layers' value heads are in llama.cpp's tiled order (a ``qwen35``
    file's: value head ``j`` served by key head ``j mod key heads``), not transformers'
    grouped one (by key head ``j // (value heads / key heads)``)."""
    attention_output_gate: bool = False
    """The attention's output times the sigmoid of a gate the q projection also gives, per
    head beside its query (Qwen3.5's)."""

    mla_shape: tuple[int, ...] = ()
    """Multi-head latent attention's ``(q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim)`` (DeepSeek-V2/V3's: ``models/deepseek.py``; the cache
    holds one KV head of ``kv_lora_rank + qk_rope_head_dim``); empty: none."""
    rope_interleaved: bool = False
    """The rotated dimensions turn in adjacent pairs ``(2i, 2i + 1)`` as the checkpoint
    lays them out (DeepSeek's), reordered at load into half-offset pairs."""

    text_of: str = ""
    """The vision-language class whose language model this is (``models/multimodal.py``; its
    weights renamed, the vision tower's not read); empty for a causal LM."""

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (not self.moe_layers or bool(self.moe_layers[index]))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        text_of = wrapper_of(cfg) or ""
        cfg = text_config(cfg)  # (a vision-language checkpoint's language model)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; FreeToken runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}, and the language model of "
                f"{', '.join(sorted(WRAPPERS))}")
        family = SUPPORTED_ARCHITECTURES[arch]
        if family in PREPARED:
            cfg = PREPARED[family](cfg)
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
        use_window = cfg.get("use_sliding_window", family in ("mistral", "mixtral", "ministral3"))
        # transformers' Gemma reads hidden_activation (default gelu_pytorch_tanh) only.
        hidden_act = ((cfg.get("hidden_activation") or "gelu_pytorch_tanh")
                      if family in ("gemma2", "gemma3", "gemma4", "gemma3n")
                      else (cfg.get("hidden_act") or DEFAULT_ACTIVATIONS.get(family, "silu")))
        expected = ACTIVATIONS.get(family)
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
            "gated_mlp": family not in ("arcee", "starcoder2", "apertus"),
            "qk_norm_after_rope": family in ("hunyuan_dense", "hunyuan_moe"),
        }
        if family in FIELDS:
            fields.update(FIELDS[family](cfg))
        elif family in ("phi3", "gpt_oss", "glm4"):  # (their rope read with the config's)
            fields.update(ROPE_FIELDS[family](cfg, rope_scaling))
        elif family in ("granite", "granitemoe"):
            fields.update(granite_fields(cfg, arch))
            if family == "granitemoe":
                fields.update(moe_fields(cfg, arch, family))
        elif family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"):
            fields.update(moe_fields(cfg, arch, family))
        elif family in ("cohere", "cohere2"):
            fields.update(cohere_fields(cfg, family))
        fields["mxfp4_experts"] = quantized_experts(arch, family,
                                                    cfg.get("quantization_config"))
        fields["text_of"] = text_of
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
                                                               family in ("gpt_oss", "glm4")))
                            or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
            qk_norm=(family in ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3",
                                "gemma4", "qwen3_moe", "olmo2", "olmo3", "exaone4", "olmoe",
                                "hunyuan_dense", "hunyuan_moe", "lfm2", "lfm2_moe",
                                "minimax_m2", "apertus", "dots1", "gemma3n")
                     or (family in ("cohere", "glm4_moe", "phi", "llama4") and bool(cfg.get("use_qk_norm")))),
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
                data = with_overrides(data, overrides)
            return cls.from_dict(data)
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}; expected a Hugging Face "
                                 "config.json of a Llama-family model") from exc
