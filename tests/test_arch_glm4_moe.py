"""GLM-4.5 (``Glm4MoeForCausalLM`` directories), exact against transformers: greedy tokens and
every position's logits. A tiny random GLM-4.5: q/k/v biases and q/k norms, RoPE on half of
each head, one dense layer then experts chosen by sigmoid scores plus a selection bias among
the best 2 of 4 groups, ungated shared experts, and a multi-token-prediction layer in the
checkpoint that is not read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, served
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_glm4_moe_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(
        tmp_path, Glm4MoeConfig, Glm4MoeForCausalLM, num_hidden_layers=3, head_dim=16,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    hf = Glm4MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # (the selection bias changes which experts are chosen)
        gen = torch.Generator().manual_seed(5)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    hf.save_pretrained(model_dir)
    # a multi-token-prediction layer, as the released checkpoints hold (not read)
    shard = next(model_dir.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, shard, metadata={"format": "pt"})
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "glm4_moe" and model.config.qk_norm
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert all(layer.moe.shared_gate is None for layer in model.layers[1:])
    assert_matches(llm, hf, 5, [[70]])


def test_glm4_moe_config_defaults_and_errors() -> None:
    base = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16}
    cfg = ModelConfig.from_dict(base)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8,
                                                                                      1408)
    assert cfg.moe_layers == (0, 1, 1, 1) and cfg.expert_gating == "sigmoid"
    assert cfg.partial_rotary_factor == 0.5 and not cfg.qk_norm
    assert cfg.shared_expert_intermediate_size == 1408 and cfg.expert_groups == (1, 1)
    for bad, match in (({"n_group": 3}, "n_group"), ({"topk_group": 2}, "topk_group"),
                       ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
                       ({"hidden_act": "gelu"}, "silu")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
