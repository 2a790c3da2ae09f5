"""transformers' model of a GGUF file: the oracle the native model is compared with.

transformers' GGUF loader dequantizes every weight to float32 (gguf-py's ``dequantize``),
un-permutes llama's q/k rows and undoes Gemma's norm offset, independently of FreeToken's
reader. Loaded once per file and test session."""

from __future__ import annotations

import functools
from pathlib import Path

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


def hf_mixtral_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' ``MixtralForCausalLM`` of a ``llama`` GGUF file with experts (Mixtral's,
    which transformers' GGUF loader reads as a dense Llama): every tensor dequantized by
    gguf-py, q/k un-permuted by transformers' ``LlamaTensorProcessor``, the experts'
    slices stacked as transformers 5 holds them (gate and up rows in one tensor)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(str(path))

    def key(name: str) -> object:
        return reader.fields[name].contents()

    tensors = {t.name: torch.from_numpy(np.array(
        dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in reader.tensors}
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
