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


def test_nemotron_h_config_keys_defaults_and_errors() -> None:
    base = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "hybrid_override_pattern": "M-*", "layer_norm_epsilon": 1e-4, "mamba_d_conv": 3}
    cfg = ModelConfig.from_dict(base)
    assert cfg.num_layers == 3 and cfg.layer_kinds == ("mamba", "mlp", "attention")
    assert cfg.mamba_shape == (128, 64, 8, 128, 3, 128) and cfg.rms_norm_eps == 1e-4
    for bad, match in (({"hybrid_override_pattern": "M-E"}, "mixture-of-experts"),
                       ({"hybrid_override_pattern": "MX"}, "hybrid_override_pattern"),
                       ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
                       ({"mamba_num_heads": 12}, "n_groups")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
