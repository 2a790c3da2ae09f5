"""Nemotron-H (``NemotronHForCausalLM`` directories: Nemotron-H, Nemotron Nano 2), exact against
transformers: greedy tokens and every position's logits, its Mamba-2 blocks' states kept per
sequence by the engine. A tiny random model of the released pattern's three kinds of block
(``M-M*-M``: Mamba-2, ReLU² MLP, attention without positional encoding), its Mamba-2 in 2
groups and chunks of 8 tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from transformers import NemotronHConfig
from transformers import NemotronHForCausalLM as HFNemotronH

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.kv_layout import kv_cache_dims

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE: dict[str, Any] = {
    "layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention",
                          "mlp", "linear_attention"],
    "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2,
    "ssm_state_size": 16, "chunk_size": 8, "intermediate_size": 96}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("nemotron_h"), NemotronHConfig,
                           HFNemotronH, **SHAPE)


def test_nemotron_h_directory_matches_transformers(model_dir: Path) -> None:
    hf = HFNemotronH.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = assert_matches(llm, hf, 7, [[], [1, 1, 70]])
    assert model.config.layer_kinds == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba")
    assert kv_cache_dims(model.config) == (1, 2, 16)
    llm = served(model_dir, kv_cache_tokens=192, block_size=8, max_num_seqs=4)
    prompts = prompts_of(llm, 7)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_nemotron_3_nano_moe_directory_matches_transformers(tmp_path: Path) -> None:
    # (ungated ReLU² experts chosen by sigmoid scores plus a selection bias among groups)
    model_dir = save_tiny_model(
        tmp_path, NemotronHConfig, HFNemotronH, **{**SHAPE, "layers_block_type": [
            "linear_attention", "moe", "full_attention", "moe", "linear_attention"]},
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=4, topk_group=2,
        routed_scaling_factor=2.0)
    hf = HFNemotronH.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # (the selection bias changes which experts are chosen)
        gen = torch.Generator().manual_seed(4)
        for layer in (hf.model.layers[1], hf.model.layers[3]):
            layer.mixer.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    hf.save_pretrained(model_dir)
    model = assert_matches(served(model_dir), hf, 5, [[70]])
    assert [layer.moe is not None for layer in model.layers] == [False, True, False, True,
                                                                 False]
    assert not model.layers[1].moe.gated and model.layers[1].moe.native_args is None


def test_nemotron_h_config_keys_defaults_and_errors() -> None:
    base = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "hybrid_override_pattern": "M-*", "layer_norm_epsilon": 1e-4, "mamba_d_conv": 3}
    cfg = ModelConfig.from_dict(base)
    assert cfg.num_layers == 3 and cfg.layer_kinds == ("mamba", "mlp", "attention")
    assert cfg.mamba_shape == (128, 64, 8, 128, 3, 128) and cfg.rms_norm_eps == 1e-4
    assert ModelConfig.from_dict({**base, "hybrid_override_pattern": "M-E"}).moe_layers == (
        0, 0, 1)
    for bad, match in (({"hybrid_override_pattern": "M-E", "moe_latent_size": 64},
                        "moe_latent_size"),
                       ({"hybrid_override_pattern": "MX"}, "hybrid_override_pattern"),
                       ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
                       ({"mamba_num_heads": 12}, "n_groups")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
