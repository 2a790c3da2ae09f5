"""ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM`` directories: ERNIE-4.5-21B-A3B, 300B-A47B),
exact against transformers: greedy tokens and every position's logits. A tiny random model:
ERNIE 4.5's whole-head rotary on adjacent pairs (tests/test_arch_ernie4_5.py), a dense first
layer, then experts chosen by their softmax probabilities plus a selection bias and weighted
by the probabilities, beside two shared experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, served
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ernie4_5_moe_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(
        tmp_path, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, num_hidden_layers=3,
        head_dim=32, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
        moe_num_shared_experts=2, moe_layer_start_index=1)
    hf = Ernie4_5_MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # (the selection bias changes which experts are chosen)
        gen = torch.Generator().manual_seed(6)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.2, generator=gen)
    hf.save_pretrained(model_dir)
    model = assert_matches(served(model_dir), hf, 5, [[70]])
    assert model.config.architecture == "ernie4_5_moe"
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert model.layers[1].moe.selection_bias is not None


def test_ernie4_5_moe_config_defaults_and_errors() -> None:
    base = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 64,
            "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "head_dim": 16}
    cfg = ModelConfig.from_dict(base)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 6,
                                                                                      1536)
    assert cfg.moe_layers == (0, 1, 1, 1) and cfg.shared_expert_intermediate_size == 3072
    cfg = ModelConfig.from_dict({**base, "moe_layer_interval": 2, "moe_layer_end_index": 2})
    assert cfg.moe_layers == (0, 1, 0, 0)
    for bad, match in (({"moe_k": 65}, "moe_k"), ({"moe_num_experts": 0}, "moe_num_experts")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
