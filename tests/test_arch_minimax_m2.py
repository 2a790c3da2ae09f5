"""MiniMax-M2 (``MiniMaxM2ForCausalLM`` directories, ``minimax-m2`` GGUF files), exact against
transformers: greedy tokens and every position's logits. A tiny random MiniMax-M2: RMSNorms
over all the heads' queries and keys, RoPE on the first ``rotary_dim`` of each head (NEOX
pairs), experts in every layer chosen by sigmoid scores plus a selection bias and rescaled;
the checkpoint's released names (``block_sparse_moe``, ``w1``/``w2``/``w3``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from gguf_minimax_files import minimax_model, write_minimax_gguf
from safetensors.torch import load_file
from test_arch_gemma3 import engine_path
from test_arch_glm4_moe import gguf_served
from test_arch_phi3 import save_model
from test_arch_qwen3_5 import assert_matches, served
from tiny_models import build_tokenizer

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the GGUF files take)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_minimax_m2_directory_matches_transformers(tmp_path: Path, path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = minimax_model(len(build_tokenizer(tmp_path)), seed=2)
    save_model(hf, tmp_path)
    names = set(load_file(next(tmp_path.glob("*.safetensors"))))
    assert {"model.layers.0.block_sparse_moe.experts.0.w1.weight",  # (the released names)
            "model.layers.0.block_sparse_moe.e_score_correction_bias"} <= names
    llm = served(tmp_path)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.native is native and cfg.architecture == "minimax_m2"
    assert cfg.partial_rotary_factor == 0.5 and cfg.qk_norm
    assert all(layer.moe is not None and layer.moe.selection_bias is not None
               for layer in model.layers)
    assert model.layers[0].q_norm.numel() == 4 * 32  # (over all the heads at once)
    assert_matches(llm, hf, 7, [[], [1, 1, 70]])


@pytest.mark.parametrize(("path", "weight_type"), [("native", GGMLQuantizationType.Q8_0),
                                                   ("torch", GGMLQuantizationType.Q4_0)])
def test_minimax_m2_gguf_matches_transformers(tmp_path: Path, path: str, weight_type: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = write_minimax_gguf(tmp_path / "m2.gguf", minimax_model(VOCAB, seed=3), weight_type)
    llm = gguf_served(tmp_path / "m2.gguf")
    model = llm.engine.core.runner.model
    assert model.uses_gguf_blocks and model.native is native
    assert model.config.architecture == "minimax_m2" and model.config.partial_rotary_factor == 0.5
    assert_matches(llm, hf, 5, [[70]])


def test_minimax_m2_config_defaults_and_errors(tmp_path: Path) -> None:
    base = {"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = ModelConfig.from_dict(base)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8,
                                                                                      1536)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.partial_rotary_factor) == (128, 8, 1.0)
    assert cfg.expert_gating == "sigmoid" and cfg.expert_selection_bias and cfg.norm_topk_prob
    assert ModelConfig.from_dict({**base, "rotary_dim": 64}).partial_rotary_factor == 0.5
    for bad, match in (({"scoring_func": "softmax"}, "scoring_func"),
                       ({"use_routing_bias": False}, "use_routing_bias"),
                       ({"shared_intermediate_size": 128}, "shared_intermediate_size"),
                       ({"qk_norm_type": "per_head"}, "qk_norm_type"),
                       ({"num_experts_per_tok": 300}, "num_experts_per_tok")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
    hf = minimax_model(VOCAB)
    write_minimax_gguf(tmp_path / "bad.gguf", hf, keys={"expert_gating_func": 1})
    with pytest.raises(ModelLoadError, match=r"minimax-m2\.expert_gating_func 1"):
        gguf_served(tmp_path / "bad.gguf")
