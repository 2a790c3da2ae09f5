"""Checkpoint tensor names that are not the names FreeToken's models read, as transformers
renames them when it loads the checkpoint (its ``conversion_mapping``, in its order): each
family's regular expressions and their replacements, applied to every tensor name of a
directory's safetensors (``loader.read_weights``)."""

from __future__ import annotations

import re
from collections.abc import Callable

_RENAMES: dict[str, list[tuple[re.Pattern[str], str]]] = {
    # EXAONE 3.0 / 3.5: GPT-2's names (config_defaults.py)
    "exaone": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"^transformer\.wte\.", "model.embed_tokens."),
        (r"^transformer\.h\.", "model.layers."),
        (r"^transformer\.ln_f\.", "model.norm."),
        (r"\.attn\.attention\.", ".self_attn."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.ln_1\.", ".input_layernorm."),
        (r"\.ln_2\.", ".post_attention_layernorm."),
        (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
        (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )],
    # Granite MoE: JetMoE's experts, gate and up in one [experts, 2 x size, hidden] tensor
    # (transformers 5's fused layout, which moe.py reads) and the router's linear
    "granitemoe": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
        (r"\.block_sparse_moe\.router\.layer\.weight$", ".mlp.gate.weight"),
    )],
    # StarCoder2: its MLP's two linears (not gated: up and down)
    "starcoder2": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )],
    # Phi: its final norm, attention output and MLP linears (not gated: up and down), q/k norms
    "phi": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"^model\.final_layernorm\.", "model.norm."),
        (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        (r"\.mlp\.fc1\.", ".mlp.up_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
        (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
        (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
    )],
    # LFM2: Llama's block under its own names (short_conv.py reads its conv layers')
    "lfm2": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"^model\.embedding_norm\.", "model.norm."),
        (r"\.operator_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
        (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
        (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
        (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
    )],
    # LFM2-MoE: LFM2's, and its experts (per expert as released, or transformers 5's fused)
    "lfm2_moe": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.feed_forward\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.feed_forward\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.feed_forward\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        (r"\.feed_forward\.experts\.", ".mlp.experts."),
        (r"\.feed_forward\.gate\.", ".mlp.gate."),
        (r"\.feed_forward\.expert_bias$", ".mlp.expert_bias"),
    )],
    # MiniMax-M2: its experts' block's selection bias (as released, or as transformers 5
    # saves it), under the name moe.py reads
    "minimax_m2": [(re.compile(r"\.(block_sparse_moe|mlp)\.e_score_correction_bias$"),
                    ".mlp.expert_bias")],
    # GLM-4.5, DeepSeek-V3, GLM-4.7-Flash, dots.llm1: the router's selection bias, under the name
    # moe.py reads
    **{family: [(re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.expert_bias")]
       for family in ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "dots1")},
    # Granite 4: Granite MoE's experts as released (JetMoE's names) or as transformers 5
    # saves them
    "granitemoehybrid": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
        (r"\.block_sparse_moe\.router\.layer\.weight$", ".mlp.gate.weight"),
        (r"\.block_sparse_moe\.router\.weight$", ".mlp.gate.weight"),
        (r"\.block_sparse_moe\.experts\.", ".mlp.experts."),
    )],
    # Nemotron-H: its released "backbone." names and its embedding's and final norm's
    "nemotron_h": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"^backbone\.", "model."),
        (r"^model\.embeddings\.", "model.embed_tokens."),
        (r"^model\.norm_f\.", "model.norm."),
    )],
    # Falcon-H1: Llama's block under its own names (falcon_h1.py reads its mixers')
    "falcon_h1": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"^model\.final_layernorm\.", "model.norm."),
        (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.", ".mlp."),
    )],
    # ERNIE 4.5 MoE: the router's selection bias, as released or as transformers 5 saves it
    "ernie4_5_moe": [(re.compile(r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$"),
                      ".mlp.expert_bias")],
    # Hunyuan dense: its q/k norms (normed after the rotation: llama.py)
    "hunyuan_dense": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
        (r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."),
    )],
    # Hunyuan MoE: the dense model's, the router and the shared MLP under moe.py's names
    "hunyuan_moe": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.mlp\.gate\.wg\.", ".mlp.gate."),
        (r"\.mlp\.shared_mlp\.", ".mlp.shared_experts."),
    )],
    # Apertus: Llama's two norms a block under its own names
    "apertus": [(re.compile(pattern), replacement) for pattern, replacement in (
        (r"\.attention_layernorm\.", ".input_layernorm."),
        (r"\.feedforward_layernorm\.", ".post_attention_layernorm."),
    )],
}
_RENAMES["hunyuan_moe"] += _RENAMES["hunyuan_dense"]


_RENAMES["lfm2_moe"] += _RENAMES["lfm2"]


def weight_renamer(family: str) -> Callable[[str], str] | None:
    """The function that gives a ``family`` checkpoint's tensor name as the model's (names
    already the model's unchanged), None where the family's names are the model's."""
    renames = _RENAMES.get(family)
    if renames is None:
        return None

    def rename(name: str) -> str:
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        return name

    return rename
