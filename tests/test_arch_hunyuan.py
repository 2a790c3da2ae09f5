"""Hunyuan dense (``HunYuanDenseV1ForCausalLM`` directories, ``hunyuan-dense`` GGUF files:
Hunyuan 0.5B-7B Instruct), exact against transformers: greedy tokens and every position's
logits.

Llama's model with per-head q/k RMSNorms applied to the *rotated* queries and keys (Qwen3's
norm them before the rotation), and the checkpoints' rope type ``dynamic`` with a fixed
``alpha``: NTK-alpha scaling, the default rope of base ``rope_theta * alpha ** (d / (d - 2))``,
which llama.cpp's converter writes as the file's ``rope.freq_base``. The GGUF file's
reference is built from gguf-py's dequantization (transformers' GGUF loader does not read
hunyuan-dense)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_hunyuan_dense_from_gguf
from test_arch_exaone4 import differs
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_norm_order_matters(llm, ids: list[int], ref) -> None:
    """Every position's logits equal ``ref``'s; with the q/k norms before the rotation they
    differ."""
    model, want = matching_logits(llm, ids, ref)
    assert all(layer.norm_after_rope for layer in model.layers)
    try:
        for layer in model.layers:
            layer.norm_after_rope = False
        assert differs(model, ids, want)
    finally:
        for layer in model.layers:
            layer.norm_after_rope = True


def test_hunyuan_dense_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "hunyuan", HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM,
        num_hidden_layers=3, head_dim=16,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                         "rope_theta": 10000.0})
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "hunyuan_dense" and cfg.qk_norm_after_rope
    assert cfg.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
    assert got == greedy(hf, prompts, 16)
    assert_norm_order_matters(llm, prompts[-1], hf)


def test_hunyuan_dense_gguf_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "hunyuan.gguf", "hunyuan-dense", hidden=64, layers=3,
                      heads=4, kv_heads=2, ff=96, tied=False, seed=14, weight_type=Q8_0,
                      rope_theta=500000.0, types={"attn_output.weight": Q4_0})
    hf = hf_hunyuan_dense_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "hunyuan_dense" and model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_norm_order_matters(llm, prompts[-1], hf)


@pytest.mark.parametrize("arch", ["HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"])
def test_dynamic_ntk_without_alpha_is_refused(arch: str) -> None:
    with pytest.raises(ModelLoadError, match=f"^{arch} with rope type 'dynamic'"):
        ModelConfig.from_dict({"architectures": [arch],
                               "hidden_size": 64, "num_attention_heads": 4,
                               "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_hunyuan_moe_directory_matches_transformers(tmp_path: Path) -> None:
    # (Hunyuan-A13B's shape: every layer's experts beside a shared SwiGLU MLP)
    import torch
    from test_arch_phi3 import save_tiny_model
    from test_arch_qwen3_5 import assert_matches
    from test_arch_qwen3_5 import served as served_hybrid
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    model_dir = save_tiny_model(
        tmp_path, HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM, num_hidden_layers=2,
        head_dim=16, num_experts=4, moe_topk=2, intermediate_size=32, use_qk_norm=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                         "rope_theta": 10000.0})
    hf = HunYuanMoEV1ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = assert_matches(served_hybrid(model_dir), hf, 5, [[70]])
    assert model.config.architecture == "hunyuan_moe" and model.config.qk_norm_after_rope
    assert all(layer.moe is not None and layer.moe.shared_gate is None
               for layer in model.layers)
