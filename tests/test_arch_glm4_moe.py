"""GLM-4.5 (``Glm4MoeForCausalLM`` directories, ``glm4moe`` GGUF files), exact against
transformers: greedy tokens and every position's logits. A tiny random GLM-4.5: q/k/v biases
and q/k norms, RoPE on half of each head, one dense layer then experts chosen by sigmoid
scores plus a selection bias among the best 2 of 4 groups, ungated shared experts, and a
multi-token-prediction layer in the checkpoint (or the file) that is not read. The GGUF
files' metadata errors name their key."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_glm4moe_files import glm4moe_model, mtp_layer, write_glm4moe_gguf
from safetensors.torch import load_file, save_file
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the GGUF files take)


def gguf_served(path: Path) -> Any:
    """``path`` served, its config built afresh (the files here are the same bytes at every
    run: a conversion cached by an earlier run would stand in for the metadata's reading)."""
    from freetoken_core.models.resolve import converted_dir, default_gguf_path

    assert default_gguf_path().exists()
    shutil.rmtree(converted_dir(path), ignore_errors=True)
    return served(path)


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


# GGUF files (glm4moe) as llama.cpp's converter writes them (tests/gguf_glm4moe_files.py),
# with the default model's vocabulary: GLM-4.5-like (q/k norms, groups, an MTP layer) and
# GLM-4.5-Air-like (no q/k norms, one group, the top k not rescaled), in two block types.
GGUF_SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    "glm-4.5-like": ({}, GGMLQuantizationType.Q8_0),
    "air-like": ({"use_qk_norm": False, "n_group": 1, "topk_group": 1,
                  "norm_topk_prob": False}, GGMLQuantizationType.Q4_0),
}


@pytest.mark.parametrize(("shape", "path"), [("glm-4.5-like", "native"),
                                             ("air-like", "native"), ("glm-4.5-like", "torch")])
def test_glm4_moe_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    overrides, weight_type = GGUF_SHAPES[shape]
    hf = glm4moe_model(VOCAB, seed=3, **overrides)
    file = tmp_path / "glm4moe.gguf"
    hf = write_glm4moe_gguf(file, hf, mtp_layer(hf), weight_type=weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.uses_gguf_blocks and cfg.architecture == "glm4_moe" and model.native is native
    assert cfg.num_layers == 3 and len(model.layers) == 3  # (the MTP layer not run)
    assert cfg.qk_norm is hf.config.use_qk_norm and cfg.partial_rotary_factor == 0.5
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert all(layer.moe.shared_gate is None and layer.moe.selection_bias is not None
               and (layer.moe.native_args is not None) is native  # (one native call)
               for layer in model.layers[1:])
    prompts = prompts_of(llm, 5)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)
    ids = prompts[1]
    assert_chunks_match(model, hf, ids, [70, len(ids) - 70])


def test_glm4_moe_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    hf = glm4moe_model(VOCAB)
    path = tmp_path / "glm4moe.gguf"
    write_glm4moe_gguf(path, hf, mtp_layer(hf))
    config = build_config(open_header(path))
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3, 1)
    from_file = ModelConfig.from_dict(config)
    from_hf = ModelConfig.from_dict({**hf.config.to_dict(),
                                     "architectures": ["Glm4MoeForCausalLM"]})
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "partial_rotary_factor", "qk_norm", "attention_bias", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "expert_gating", "expert_selection_bias",
                 "expert_groups", "expert_norm_eps", "norm_topk_prob",
                 "routed_scaling_factor", "moe_layers", "intermediate_size"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # (float32 in the file)


@pytest.mark.parametrize(("drop", "keys", "match"), [
    (("expert_shared_count",), {}, "lacks 'glm4moe.expert_shared_count'"),
    ((), {"expert_gating_func": 1}, r"glm4moe\.expert_gating_func 1 .*sigmoid, 2"),
    ((), {"nextn_predict_layers": 4}, r"glm4moe\.nextn_predict_layers 4"),
    ((), {"expert_group_count": 3}, r"glm4moe\.expert_group_count 3"),
    ((), {"leading_dense_block_count": 9}, r"glm4moe\.leading_dense_block_count 9"),
    ((), {"rope.dimension_count": 7}, r"glm4moe\.rope\.dimension_count 7"),
    ((), {"nextn_predict_layers": 0}, r"'blk\.3\.nextn\.[a-z_]+\.weight' belongs to a multi"),
])
def test_glm4_moe_gguf_metadata_errors_name_the_key(tmp_path: Path, drop: tuple[str, ...],
                                                    keys: dict[str, Any], match: str) -> None:
    hf = glm4moe_model(VOCAB)
    path = tmp_path / "bad.gguf"
    write_glm4moe_gguf(path, hf, mtp_layer(hf), drop_keys=drop, keys=keys)
    with pytest.raises(ModelLoadError, match=match):
        gguf_served(path)
