"""transformers' models of GGUF files of the families its GGUF loader does not read (OLMo 2/3,
OLMoE, Granite MoE, EXAONE 3/4, ERNIE 4.5, Seed-OSS, Arcee, StarCoder2, Hunyuan dense, Cohere):
the exactness tests' oracles, each built from gguf-py's dequantization of every tensor under
the name llama.cpp's converter gave it (``gguf_reference`` has the families it reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf_reference import _dequantized


def hf_olmo_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``Olmo2ForCausalLM`` (``Olmo3ForCausalLM`` where the file has
    ``attention.sliding_window``: every 4th layer global) of an ``olmo2`` GGUF file, or its
    ``Exaone4ForCausalLM`` of an ``exaone4`` one (with a window: every 4th layer global and
    not rotated), neither of which transformers' GGUF loader reads: every tensor dequantized
    by gguf-py under the name llama.cpp's converter gave it (the weights unpermuted)."""
    from transformers import (
        Exaone4Config,
        Exaone4ForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Olmo3Config,
        Olmo3ForCausalLM,
    )

    reader, tensors, key, shape = _file_shape(path)
    arch = reader.fields["general.architecture"].contents()
    shape["rms_norm_eps"] = key("attention.layer_norm_rms_epsilon")
    theta = key("rope.freq_base")
    window = key("attention.sliding_window")
    if arch == "exaone4":
        layers = shape["num_hidden_layers"]
        model = Exaone4ForCausalLM(Exaone4Config(
            **shape, head_dim=key("attention.key_length"), sliding_window=window,
            layer_types=None if window else ["full_attention"] * layers,
            rope_parameters={"rope_type": "default", "rope_theta": theta}))
    elif window:
        config = Olmo3Config(**shape, sliding_window=window, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": theta}})
        model = Olmo3ForCausalLM(config)
    else:
        model = Olmo2ForCausalLM(Olmo2Config(**shape, rope_theta=theta))
    names = {"post_attention_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"},
             **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
    return _loaded(model, tensors, names)


def hf_olmoe_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``OlmoeForCausalLM`` of an ``olmoe`` GGUF file (transformers' GGUF loader
    does not read it): q/k norms over all heads, experts of ``feed_forward_length`` stacked
    as transformers 5 holds them (gate and up rows in one tensor), the top k not
    renormalized (llama.cpp's ``norm_w`` false), the q/k rows as stored."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    _, tensors, key, shape = _file_shape(path)
    model = OlmoeForCausalLM(OlmoeConfig(
        **shape, rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")}))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_gate_inp.weight": "mlp.gate.weight",
             "ffn_down_exps.weight": "mlp.experts.down_proj",
             **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"}}
    extra = {f"model.layers.{i}.mlp.experts.gate_up_proj": torch.cat(
        [tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]], 1)
        for i in range(shape["num_hidden_layers"])}
    return _loaded(model, tensors, names, extra=extra)


def hf_granitemoe_from_gguf(path: Path, **config: object) -> torch.nn.Module:
    """transformers' ``GraniteMoeForCausalLM`` of a ``granitemoe`` GGUF file (transformers'
    GGUF loader does not read it), its multipliers ``config``: q/k un-permuted by
    transformers' ``LlamaTensorProcessor`` (its converter is Llama's), the experts of
    ``feed_forward_length`` stacked as transformers 5 holds them (gate and up rows in one
    tensor), the router's linear."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, tensors, key, shape = _file_shape(path)
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    model = GraniteMoeForCausalLM(GraniteMoeConfig(
        **shape, rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")},
        **config))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_gate_inp.weight": "block_sparse_moe.router.weight",
             "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj",
             **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"}}

    def value(short: str, tensor: torch.Tensor) -> torch.Tensor:
        if short in ("attn_q.weight", "attn_k.weight"):
            return torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(
                tensor.numpy(), heads, heads if short == "attn_q.weight" else kv_heads))
        return tensor

    extra = {f"model.layers.{i}.block_sparse_moe.experts.gate_up_proj": torch.cat(
        [tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]], 1)
        for i in range(shape["num_hidden_layers"])}
    return _loaded(model, tensors, names, value, extra)


def hf_exaone_from_gguf(path: Path, **config: object) -> torch.nn.Module:
    """transformers' model of an ``exaone`` GGUF file (its ``LlamaForCausalLM`` of an
    ``ExaoneConfig``; transformers' GGUF loader does not read exaone), ``config`` added to
    its config (e.g. the rope parameters ``rope_freqs`` stands for); the converter does not
    permute exaone's q/k rows."""
    from transformers import ExaoneConfig, LlamaForCausalLM

    return _llama_like(path, ExaoneConfig, LlamaForCausalLM, **config)


def hf_ernie4_5_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``Ernie4_5ForCausalLM`` of an ``ernie4_5`` GGUF file (its converter's
    ``Ernie4_5Model`` is a ``TextModel``, not a ``LlamaModel``: the q/k rows unpermuted),
    ``use_bias`` where the file has biases."""
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    return _llama_like(path, Ernie4_5Config, Ernie4_5ForCausalLM,
                       present={"use_bias": "blk.0.attn_q.bias"})


def hf_seed_oss_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``SeedOssForCausalLM`` of a ``seed_oss`` GGUF file (q/k/v biases, the
    MLP's input norm named ``post_attention_norm``, the q/k rows unpermuted)."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    return _llama_like(path, SeedOssConfig, SeedOssForCausalLM,
                       present={"attention_bias": "blk.0.attn_q.bias",
                                "attention_out_bias": "blk.0.attn_output.bias"})


def hf_arcee_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``ArceeForCausalLM`` of an ``arcee`` GGUF file (its converter is
    Llama's: the q/k rows permuted, which transformers' ``LlamaTensorProcessor`` undoes)."""
    from transformers import ArceeConfig, ArceeForCausalLM

    return _llama_like(path, ArceeConfig, ArceeForCausalLM, unpermute=True)


def hf_starcoder2_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``Starcoder2ForCausalLM`` of a ``starcoder2`` GGUF file (LayerNorms and
    linears with biases, ``ffn_up`` / ``ffn_down`` as ``c_fc`` / ``c_proj``, no window: the
    converter writes none), the q/k rows as stored."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    names = {f"ffn_norm.{kind}": f"post_attention_layernorm.{kind}" for kind in ("weight",
                                                                                "bias")}
    names.update({f"attn_norm.{kind}": f"input_layernorm.{kind}" for kind in ("weight",
                                                                             "bias")})
    names.update({f"ffn_{a}.{kind}": f"mlp.{b}.{kind}" for a, b in (("up", "c_fc"),
                                                                   ("down", "c_proj"))
                  for kind in ("weight", "bias")})
    return _llama_like(path, Starcoder2Config, Starcoder2ForCausalLM,
                       keys={"norm_epsilon": "attention.layer_norm_epsilon"},
                       sliding_window=None, use_bias=True, renamed=names,
                       extra={"output_norm.bias": "model.norm.bias"})


def hf_hunyuan_dense_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``HunYuanDenseV1ForCausalLM`` of a ``hunyuan-dense`` GGUF file (the
    converter writes the NTK-alpha base as ``rope.freq_base``; per-head q/k norms, applied
    after the rotation), the q/k rows as stored."""
    from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

    return _llama_like(path, HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM, renamed={
        "attn_q_norm.weight": "self_attn.query_layernorm.weight",
        "attn_k_norm.weight": "self_attn.key_layernorm.weight"})


def hf_cohere_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``CohereForCausalLM`` of a ``command-r`` GGUF file (with Command R+'s
    q/k norms where it has them) or its ``Cohere2ForCausalLM`` of a ``cohere2`` one (its
    window; every 4th layer global, as llama.cpp reads a file without a pattern), neither
    of which transformers' GGUF loader reads: every tensor dequantized by gguf-py under the
    name llama.cpp's converter gave it (the weights unpermuted, the output the embeddings)."""
    from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

    reader, tensors, key, shape = _file_shape(path)
    arch = reader.fields["general.architecture"].contents()
    shape.update(layer_norm_eps=key("attention.layer_norm_epsilon"),
                 logit_scale=key("logit_scale"), tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")})
    if arch == "cohere2":
        model = Cohere2ForCausalLM(Cohere2Config(
            **shape, sliding_window=key("attention.sliding_window")))
    else:
        model = CohereForCausalLM(CohereConfig(
            **shape, use_qk_norm="blk.0.attn_q_norm.weight" in tensors))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"},
             **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
    if "blk.0.attn_q_norm.weight" in tensors:
        names.update({"attn_q_norm.weight": "self_attn.q_norm.weight",
                      "attn_k_norm.weight": "self_attn.k_norm.weight"})
    return _loaded(model, tensors, names)


def _file_shape(path: Path) -> tuple[Any, dict[str, torch.Tensor], Any, dict[str, Any]]:
    """``path``'s reader, dequantized tensors, a reader of its architecture's keys
    (``key(name, default)``) and its shape as a transformers config's keywords (vocab from
    the embedding rows; tied where it has no ``output.weight``)."""
    reader, tensors = _dequantized(path)
    arch = reader.fields["general.architecture"].contents()

    def key(name: str, default: object = None) -> object:
        field = reader.fields.get(f"{arch}.{name}")
        return default if field is None else field.contents()

    shape = {"vocab_size": tensors["token_embd.weight"].shape[0],
             "hidden_size": key("embedding_length"),
             "intermediate_size": key("feed_forward_length"),
             "num_hidden_layers": key("block_count"),
             "num_attention_heads": key("attention.head_count"),
             "num_key_value_heads": key("attention.head_count_kv"),
             "max_position_embeddings": key("context_length"),
             "tie_word_embeddings": "output.weight" not in tensors, "pad_token_id": 0}
    return reader, tensors, key, shape


def _loaded(model: torch.nn.Module, tensors: dict[str, torch.Tensor], names: dict[str, str],
            value: Any = None, extra: dict[str, torch.Tensor] | None = None
            ) -> torch.nn.Module:
    """``model`` in float32 with the file's ``tensors``: the embeddings, the final norm,
    the head (the embeddings where the file has no ``output.weight``), each layer's tensors
    that the file has by ``names`` (file name -> the model's, under ``blk.{i}.`` /
    ``model.layers.{i}.``; ``value(name, tensor)`` what is loaded, default the tensor), and
    ``extra`` (the model's names)."""
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"],
             "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"]),
             **(extra or {})}
    for i in range(model.config.num_hidden_layers):
        for short, hf in names.items():
            if f"blk.{i}.{short}" in tensors:
                tensor = tensors[f"blk.{i}.{short}"]
                state[f"model.layers.{i}.{hf}"] = tensor if value is None else value(short,
                                                                                     tensor)
    model = model.float().eval()
    model.load_state_dict(state)
    return model


def _llama_like(path: Path, config_class: type, model_class: type, unpermute: bool = False,
                renamed: dict[str, str] | None = None, extra: dict[str, str] | None = None,
                present: dict[str, str] | None = None, keys: dict[str, str] | None = None,
                **config: object
                ) -> torch.nn.Module:
    """transformers' ``model_class`` of a GGUF file of Llama's tensors (its architecture's
    key prefix; transformers' GGUF loader reads none of these), its ``config_class`` of the
    file's shape and rope base with ``config`` added: every tensor dequantized by gguf-py
    under the name llama.cpp's converter gave it (the MLP's input norm ``ffn_norm`` or
    ``post_attention_norm``), biases where the file has them, q/k rows as stored (or
    ``unpermute``: un-permuted by transformers' ``LlamaTensorProcessor``); ``renamed``: a
    layer's tensors named otherwise, ``extra``: more of the file's tensors, by their names
    in the model; ``present``: config keys true where the file has a tensor (e.g. biases),
    ``keys``: config keys from the file's keys."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, tensors, key, shape = _file_shape(path)
    model = model_class(config_class(**{
        **shape, "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base")},
        **{name: tensor in tensors for name, tensor in (present or {}).items()},
        **{name: key(field) for name, field in (keys or {}).items()}, **config}))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
                for p in "qkv" for kind in ("weight", "bias")},
             **{f"attn_output.{kind}": f"self_attn.o_proj.{kind}" for kind in ("weight", "bias")},
             **{f"ffn_{p}.{kind}": f"mlp.{p}_proj.{kind}"
                for p in ("gate", "up", "down") for kind in ("weight", "bias")}}
    names.update(renamed or {})
    heads, kv_heads = key("attention.head_count"), key("attention.head_count_kv")

    def value(short: str, tensor: torch.Tensor) -> torch.Tensor:
        if unpermute and short in ("attn_q.weight", "attn_k.weight"):
            return torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(
                tensor.numpy(), heads, heads if short == "attn_q.weight" else kv_heads))
        return tensor

    return _loaded(model, tensors, names, value,
                   {hf: tensors[name] for name, hf in (extra or {}).items()})
