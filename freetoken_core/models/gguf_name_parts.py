"""The GGUF tensor names most families share, as the Hugging Face names FreeToken's models
read (``{e}``: an expert of a 3-d tensor): the parts each family's table of a block's
tensors (``gguf_names``, ``gguf_<family>``) is built from."""

from __future__ import annotations

# The model's own tensors (not a block's).
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # (StarCoder2's LayerNorm)
    "output.weight": "lm_head.weight",
}
# A block's tensors, by their names under ``blk.{i}.``:
ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Mixture-of-experts MLPs: the router, and each expert's slice of the 3-d expert tensors
# ([experts, out, in] as Hugging Face orders them).
MOE = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
# The router's selection bias (``e_score_correction_bias``: DeepSeek-V3's, GLM-4.5's...).
SELECTION_BIAS = {"exp_probs_b.bias": "mlp.expert_bias"}
# DeepSeek's shared experts (one SwiGLU MLP of their summed width; GLM-4.5's, dots1's).
SHARED_EXPERTS = {f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight"
                  for p in ("gate", "up", "down")}
LLAMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma's four norms a block (their weights stored as 1 + w: ``gguf_weights`` takes the 1 off).
GEMMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
