"""DeepSeek-V2/V3 and GLM-4.7-Flash (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``,
``Glm4MoeLiteForCausalLM`` directories), exact against transformers: greedy tokens and every
position's logits, with multi-head latent attention computed in its absorbed form over a
cache of one latent "head" a token.

Tiny random models: V3-like (queries through ``q_lora_rank``, YaRN with ``mscale_all_dim``
over a 64-token original length, interleaved rope pairs, one dense layer then experts chosen
by sigmoid scores plus a selection bias among the best 2 of 4 groups, a shared expert, a
multi-token-prediction layer in the checkpoint that is not read); V2-like (queries straight
from ``q_proj``, softmax routing among the groups of the best single probability, or greedy
as V2-Lite); GLM-4.7-Flash-like (``mlp_layer_types``, its own head sizes and norm eps)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_arch_gemma3 import engine_path
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, served
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
)

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.kv_layout import kv_cache_dims

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
       "num_hidden_layers": 3, "num_key_value_heads": 4, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
V3 = {**MLA, "q_lora_rank": 24, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
      "routed_scaling_factor": 2.5,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 64, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}


def with_selection_bias(model_dir: Path, model_class: type) -> Any:
    """The saved model with random ``e_score_correction_bias`` (which changes the experts
    chosen), saved again, and a multi-token-prediction layer's weight added to the
    checkpoint; returns the transformers model."""
    hf = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    hf.save_pretrained(model_dir)
    shard = next(model_dir.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors[f"model.layers.{hf.config.num_hidden_layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, shard, metadata={"format": "pt"})
    return hf


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("deepseek_v3"), DeepseekV3Config,
                           DeepseekV3ForCausalLM, **V3)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_deepseek_v3_directory_matches_transformers(v3_dir: Path, path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = with_selection_bias(v3_dir, DeepseekV3ForCausalLM)
    llm = served(v3_dir)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.native is native and cfg.architecture == "deepseek_v3"
    assert cfg.mla_shape == (24, 32, 16, 8, 12) and cfg.rope_interleaved
    assert kv_cache_dims(cfg) == (3, 1, 40)  # (a latent and a rotated key part a token)
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert all(layer.moe.selection_bias is not None for layer in model.layers[1:])
    # (qk_head_dim ** -0.5 times YaRN's mscale of mscale_all_dim 1, squared)
    assert cfg.query_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4) + 1) ** 2)
    assert_matches(llm, hf, 7, [[], [1, 1, 70], [64, 64]])


@pytest.mark.parametrize("method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_directory_matches_transformers(tmp_path: Path, method: str) -> None:
    # (3 experts a token from the best of 2 groups of 4: not the 3 best of all 8)
    groups = ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}
              if method != "greedy" else {})
    model_dir = save_tiny_model(tmp_path, DeepseekV2Config, DeepseekV2ForCausalLM,
                                **{**MLA, **groups}, q_lora_rank=None, n_shared_experts=2,
                                topk_method=method, routed_scaling_factor=1.5)
    hf = DeepseekV2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert cfg.architecture == "deepseek_v2" and cfg.mla_shape == (0, 32, 16, 8, 12)
    assert cfg.expert_gating == "softmax" and cfg.expert_group_by_max
    assert (model.layers[1].moe.groups is None) is (method == "greedy")
    assert_matches(llm, hf, 5, [[70]])


def test_glm4_moe_lite_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(
        tmp_path, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, num_hidden_layers=3,
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=20, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        n_shared_experts=1, routed_scaling_factor=1.8, rms_norm_eps=1e-5,
        mlp_layer_types=["sparse", "dense", "sparse"])
    hf = with_selection_bias(model_dir, Glm4MoeLiteForCausalLM)
    with torch.no_grad():  # (latents of mean square ~1e-6: the latent norms' eps matters)
        for layer in hf.model.layers:
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(1e-3)
    hf.save_pretrained(model_dir)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "glm4_moe_lite"
    assert [layer.moe is None for layer in model.layers] == [False, True, False]
    assert_matches(llm, hf, 5, [[70]])


def test_mla_config_defaults_and_errors() -> None:
    base = {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4}
    v3 = ModelConfig.from_dict({**base, "architectures": ["DeepseekV3ForCausalLM"]})
    assert v3.mla_shape == (1536, 512, 128, 64, 128) and v3.rope_interleaved
    assert (v3.num_experts, v3.num_experts_per_tok, v3.expert_groups) == (256, 8, (8, 4))
    assert v3.moe_layers == (0, 0, 0, 1) and v3.routed_scaling_factor == 2.5
    assert v3.expert_gating == "sigmoid" and v3.expert_selection_bias and v3.norm_topk_prob
    assert (v3.head_dim, v3.num_kv_heads, v3.query_scale) == (64, 1, 192 ** -0.5)
    assert v3.shared_expert_intermediate_size == 2048 and (v3.bos_token_id, v3.eos_token_ids
                                                           ) == (0, (1,))
    plain = ModelConfig.from_dict({**base, "architectures": ["DeepseekV3ForCausalLM"],
                                   "rope_interleave": False})
    assert not plain.rope_interleaved
    v2 = {**base, "architectures": ["DeepseekV2ForCausalLM"], "num_experts_per_tok": 6}
    cfg = ModelConfig.from_dict(v2)
    assert cfg.expert_groups == (1, 1) and not cfg.norm_topk_prob and cfg.moe_layers == (1,) * 4
    assert cfg.rope_interleaved and cfg.shared_expert_intermediate_size == 2 * 1407
    lite = ModelConfig.from_dict({**base, "architectures": ["Glm4MoeLiteForCausalLM"]})
    assert lite.moe_layers == (0, 1, 1, 1) and lite.mla_shape == (768, 512, 192, 64, 256)
    for config, match in (
            ({**v2, "num_experts_per_tok": None}, "num_experts_per_tok"),
            ({**v2, "norm_topk_prob": True}, "norm_topk_prob"),
            ({**v2, "topk_method": "noaux_tc"}, "topk_method"),
            ({**v2, "scoring_func": "sigmoid"}, "scoring_func"),
            ({**v2, "moe_layer_freq": 2}, "moe_layer_freq"),
            ({**v2, "mlp_bias": True}, "mlp_bias"),
            ({**v2, "qk_rope_head_dim": 7}, "qk_rope_head_dim"),
            ({**v2, "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
             "n_group"),
            ({**base, "architectures": ["Glm4MoeLiteForCausalLM"],
              "mlp_layer_types": ["dense"]}, "mlp_layer_types"),
            ({**base, "architectures": ["DeepseekV3ForCausalLM"],
              "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
             "partial_rotary_factor")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict(config)
