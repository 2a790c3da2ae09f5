"""dots.llm1 (``Dots1ForCausalLM`` directories, ``dots1`` GGUF files), exact against
transformers: greedy tokens and every position's logits. A tiny random dots.llm1: Qwen3's
attention (per-head q/k norms, whole-head rotary), one dense layer then experts chosen by
sigmoid scores plus a selection bias among the best 2 of 4 groups beside a shared expert,
and (directories) a sliding-window layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_glm4moe_files import write_glm4moe_gguf
from test_arch_gemma3 import engine_path
from test_arch_glm4_moe import gguf_served
from test_arch_phi3 import random_model, save_model
from test_arch_qwen3_5 import assert_matches, served
from tiny_models import build_tokenizer
from transformers import Dots1Config, Dots1ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the GGUF files take)


def dots1_model(vocab_size: int, seed: int = 0, **overrides: object) -> Dots1ForCausalLM:
    """transformers' tiny float32 dots.llm1 (hidden 64, 4 heads of 16, 3 layers, 8 experts
    of 32 in 4 groups, 2 a token, a shared expert, a routed scale of 2.5) with a selection
    bias that changes the choice."""
    config = Dots1Config(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2, "sliding_window": None, **overrides})
    config.architectures = ["Dots1ForCausalLM"]
    model = random_model(Dots1ForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    return model


@pytest.mark.parametrize("path", ["native", "torch"])
def test_dots1_directory_matches_transformers(tmp_path: Path, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = dots1_model(len(build_tokenizer(tmp_path)), seed=2, sliding_window=24,
                     layer_types=["full_attention", "sliding_attention", "full_attention"])
    save_model(hf, tmp_path)
    llm = served(tmp_path)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.native is native and cfg.architecture == "dots1" and cfg.qk_norm
    assert cfg.layer_windows == (None, 24, None) and cfg.expert_groups == (4, 2)
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert_matches(llm, hf, 7, [[], [1, 1, 70]])


@pytest.mark.parametrize(("path", "weight_type"), [("native", GGMLQuantizationType.Q8_0),
                                                   ("torch", GGMLQuantizationType.Q4_0)])
def test_dots1_gguf_matches_transformers(tmp_path: Path, path: str, weight_type: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file = tmp_path / "dots1.gguf"
    hf = write_glm4moe_gguf(file, dots1_model(VOCAB, seed=3), weight_type=weight_type,
                            arch="dots1")
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.uses_gguf_blocks and model.native is native and cfg.architecture == "dots1"
    assert cfg.expert_groups == (4, 2) and cfg.norm_topk_prob
    assert_matches(llm, hf, 5, [[70]])


def test_dots1_config_defaults_and_errors() -> None:
    base = {"architectures": ["Dots1ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1}
    cfg = ModelConfig.from_dict(base)
    assert cfg.moe_intermediate_size == 1408 and cfg.moe_layers == (1, 1, 1)
    assert cfg.expert_groups == (1, 1) and not cfg.norm_topk_prob and cfg.layer_windows == ()
    assert ModelConfig.from_dict({**base, "max_window_layers": 2}).layer_windows == (
        None, None, 4096)
    for bad, match in (({"n_routed_experts": None}, "n_routed_experts"),
                       ({"n_group": 3}, "n_group"),
                       ({"layer_types": ["full_attention"]}, "layer_types"),
                       ({"max_window_layers": 0, "sliding_window": 0}, "sliding_window")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
