"""transformers' model of a GGUF file: the oracle the native model is compared with.

transformers' GGUF loader dequantizes every weight to float32 (gguf-py's ``dequantize``),
un-permutes llama's q/k rows and undoes Gemma's norm offset, independently of FreeToken's
reader. Loaded once per file and test session."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken_core.models.resolve import default_gguf_path


@functools.cache
def hf_from_gguf(path: Path | None = None, **config: object) -> torch.nn.Module:
    """transformers' float32 model of ``path`` (the default model's file if ``None``), its
    config's ``config`` keys set (those its GGUF loader does not read)."""
    from transformers import AutoModelForCausalLM

    path = Path(path) if path is not None else default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32, **config)
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


def _dequantized(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """gguf-py's reader of ``path`` and every tensor of it dequantized to float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    return reader, {t.name: torch.from_numpy(np.array(
        dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in reader.tensors}


def hf_mixtral_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``MixtralForCausalLM`` of a ``llama`` GGUF file with experts (Mixtral's,
    which transformers' GGUF loader reads as a dense Llama): every tensor dequantized by
    gguf-py, q/k un-permuted by transformers' ``LlamaTensorProcessor``, the experts'
    slices stacked as transformers 5 holds them (gate and up rows in one tensor)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader, tensors = _dequantized(path)

    def key(name: str) -> object:
        return reader.fields[name].contents()

    heads, kv_heads = key("llama.attention.head_count"), key("llama.attention.head_count_kv")
    config = MixtralConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=key("llama.embedding_length"),
        intermediate_size=key("llama.feed_forward_length"),
        num_hidden_layers=key("llama.block_count"), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=key("llama.attention.key_length"),
        rms_norm_eps=key("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=key("llama.rope.freq_base"),
        max_position_embeddings=key("llama.context_length"),
        num_local_experts=key("llama.expert_count"),
        num_experts_per_tok=key("llama.expert_used_count"),
        tie_word_embeddings="output.weight" not in tensors, pad_token_id=0)
    unpermute = LlamaTensorProcessor()._reverse_permute_weights
    names = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
             "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
             "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
             "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj"}
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"],
             "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"])}
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for short, hf in names.items():
            value = tensors[f"{b}{short}.weight"]
            if short in ("attn_q", "attn_k"):
                value = torch.from_numpy(unpermute(value.numpy(), heads,
                                                   heads if short == "attn_q" else kv_heads))
            state[p + hf] = value
        state[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"]], dim=1)
    model = MixtralForCausalLM(config).float().eval()
    model.load_state_dict(state)
    return model


def hf_gpt_oss_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``GptOssForCausalLM`` of a ``gpt-oss`` GGUF file (transformers' GGUF
    loader does not read that architecture): every tensor dequantized by gguf-py, the
    experts' gate and up columns interleaved and transposed as transformers holds them, the
    rope as llama.cpp reads the file (YaRN with its corrections floored and ceiled, the
    even layers sliding-window ones)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    reader, tensors = _dequantized(path)

    def key(name: str, default: object = None) -> object:
        field = reader.fields.get("gpt-oss." + name)
        return default if field is None else field.contents()

    layers = key("block_count")
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": key("rope.freq_base")}
    if key("rope.scaling.type") == "yarn":
        rope = {**rope, "rope_type": "yarn", "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0), "truncate": True}
    config = GptOssConfig(
        vocab_size=tensors["token_embd.weight"].shape[0], hidden_size=key("embedding_length"),
        intermediate_size=key("expert_feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=key("attention.head_count"),
        num_key_value_heads=key("attention.head_count_kv"),
        head_dim=key("attention.key_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=key("context_length"), rope_parameters=rope,
        num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        sliding_window=key("attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)],
        tie_word_embeddings="output.weight" not in tensors, pad_token_id=0)
    names = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias"}
    for short, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                        ("attn_output", "o_proj")):
        for kind in ("weight", "bias"):
            names[f"{short}.{kind}"] = f"self_attn.{proj}.{kind}"
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"],
             "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"])}
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}.mlp.experts."
        for short, hf in names.items():
            state[f"model.layers.{i}.{hf}"] = tensors[b + short]

        def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return torch.stack([gate, up], dim=-1).flatten(-2)  # gate, up, gate, up ...

        state[p + "gate_up_proj"] = interleaved(
            tensors[b + "ffn_gate_exps.weight"].transpose(1, 2),
            tensors[b + "ffn_up_exps.weight"].transpose(1, 2))
        state[p + "gate_up_proj_bias"] = interleaved(tensors[b + "ffn_gate_exps.bias"],
                                                     tensors[b + "ffn_up_exps.bias"])
        state[p + "down_proj"] = tensors[b + "ffn_down_exps.weight"].transpose(1, 2)
        state[p + "down_proj_bias"] = tensors[b + "ffn_down_exps.bias"]
    model = GptOssForCausalLM(config).float().eval()
    model.load_state_dict({k: v.contiguous() for k, v in state.items()})
    return model


def hf_glm4_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``Glm4ForCausalLM`` of a ``glm4`` GGUF file (transformers' GGUF loader
    does not read that architecture): every tensor dequantized by gguf-py under the name
    llama.cpp's converter gave it (gguf-py's tensor map for GLM4, read backwards; the
    weights unpermuted, as the converter leaves them), the rotated fraction of each head
    from ``rope.dimension_count``."""
    from transformers import Glm4Config, Glm4ForCausalLM

    reader, tensors = _dequantized(path)

    def key(name: str) -> object:
        return reader.fields["glm4." + name].contents()

    heads, head_dim = key("attention.head_count"), key("attention.key_length")
    config = Glm4Config(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=key("embedding_length"), intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv"), head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        partial_rotary_factor=key("rope.dimension_count") / head_dim,
        rope_theta=key("rope.freq_base"), max_position_embeddings=key("context_length"),
        attention_bias=True, tie_word_embeddings="output.weight" not in tensors,
        pad_token_id=0)
    names = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_self_attn_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_mlp_layernorm.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight",
             **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
                for p in "qkv" for kind in ("weight", "bias")}}
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"],
             "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"])}
    for i in range(config.num_hidden_layers):
        for short, hf in names.items():
            state[f"model.layers.{i}.{hf}"] = tensors[f"blk.{i}.{short}"]
    model = Glm4ForCausalLM(config).float().eval()
    model.load_state_dict(state)
    return model
