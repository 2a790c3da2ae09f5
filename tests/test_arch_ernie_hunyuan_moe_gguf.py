"""ERNIE 4.5 MoE (``ernie4_5-moe``) and Hunyuan MoE (``hunyuan-moe``) GGUF files, exact against
transformers: greedy tokens and every position's logits of tiny random models written as
llama.cpp's converter writes them (tests/gguf_ernie_hunyuan_files.py), against transformers'
model holding the file's dequantized weights; the config a file makes is the checkpoint's;
metadata FreeToken does not compute is refused naming the key (or the tensor).

ERNIE 4.5 MoE: its whole-head rotary on adjacent pairs (the q/k rows unpermuted), dense
layers before ``leading_dense_block_count`` and between every ``interleave_moe_layer_step``-th,
experts chosen by their softmax probabilities plus the selection bias ``exp_probs_b`` (a
``[1, experts]`` tensor) beside shared experts whose width the converter writes as
``intermediate_size // num_key_value_heads``. Hunyuan MoE: q/k norms after the rotation, the
NTK-alpha base in ``rope.freq_base``, every layer's experts beside a shared MLP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType
from gguf_ernie_hunyuan_files import (
    ALPHA,
    THETA,
    ernie_moe_model,
    hunyuan_moe_model,
    write_moe_gguf,
)
from test_arch_gemma3 import engine_path
from test_arch_glm4_moe import VOCAB, gguf_served
from test_arch_qwen3_5 import assert_matches

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header

pytestmark = pytest.mark.usefixtures("one_torch_thread")
Q8_0, Q4_0, F32 = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                   GGMLQuantizationType.F32)
# Each file's model: its layers with experts, and its overrides of the tiny model's shape.
ERNIE_SHAPES: dict[str, tuple[dict[str, Any], list[bool]]] = {
    "21b-like": ({}, [False, True, True]),  # (a dense first layer, 2 shared experts)
    "300b-like": ({"moe_num_shared_experts": 0, "moe_layer_start_index": 2,  # (no shared)
                   "num_hidden_layers": 4, "tie_word_embeddings": True},
                  [False, False, True, True]),
    "interleaved": ({"moe_layer_start_index": 0, "moe_layer_interval": 2,
                     "num_hidden_layers": 4}, [False, True, False, True]),
}


@pytest.mark.parametrize(("shape", "path", "weight_type"), [
    ("21b-like", "native", Q8_0), ("21b-like", "torch", Q4_0), ("21b-like", "native", F32),
    ("300b-like", "native", Q4_0), ("interleaved", "torch", Q8_0)])
def test_ernie4_5_moe_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                                weight_type: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    overrides, sparse = ERNIE_SHAPES[shape]
    file = tmp_path / "ernie.gguf"
    hf = write_moe_gguf(file, ernie_moe_model(VOCAB, seed=3, **overrides), weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert cfg.architecture == "ernie4_5_moe" and model.native is native
    assert model.uses_gguf_blocks  # (F32 too: the file's rows)
    assert [layer.moe is not None for layer in model.layers] == sparse
    assert all((layer.moe.shared is not None) is bool(hf.config.moe_num_shared_experts)
               and layer.moe.selection_bias is not None
               for layer in model.layers if layer.moe is not None)
    assert_matches(llm, hf, 5, [[70]])


@pytest.mark.parametrize(("path", "weight_type"), [("native", Q8_0), ("torch", Q4_0),
                                                   ("native", F32)])
def test_hunyuan_moe_gguf_matches_transformers(tmp_path: Path, path: str, weight_type: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file = tmp_path / "hunyuan.gguf"
    hf = write_moe_gguf(file, hunyuan_moe_model(VOCAB, seed=4), weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert cfg.architecture == "hunyuan_moe" and model.native is native and model.uses_gguf_blocks
    assert cfg.qk_norm_after_rope and cfg.rope_theta == pytest.approx(
        THETA * ALPHA ** (16 / 14), rel=1e-6)
    assert all(layer.moe is not None and layer.moe.shared is not None
               and layer.moe.shared_gate is None for layer in model.layers)
    assert_matches(llm, hf, 5, [[70]])


@pytest.mark.parametrize("family", ["ernie", "hunyuan"])
def test_gguf_config_is_transformers_config(tmp_path: Path, family: str) -> None:
    hf = (ernie_moe_model if family == "ernie" else hunyuan_moe_model)(VOCAB)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, hf)
    from_file = ModelConfig.from_dict(build_config(open_header(path)))
    from_hf = ModelConfig.from_dict({**hf.config.to_dict(),
                                     "architectures": hf.config.architectures})
    for name in ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "qk_norm", "qk_norm_after_rope", "attention_bias", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "expert_gating", "expert_selection_bias",
                 "norm_topk_prob", "routed_scaling_factor", "moe_layers", "intermediate_size",
                 "tie_word_embeddings", "rope_scaling"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rope_theta == pytest.approx(from_hf.rope_theta, rel=1e-6)  # (float32)
    assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)


ERRORS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # (family, the model's overrides, write_moe_gguf's arguments, the error)
    ("ernie", {}, {"drop_keys": ("interleave_moe_layer_step",)},
     "lacks 'ernie4_5-moe.interleave_moe_layer_step'"),
    ("ernie", {}, {"drop_keys": ("expert_feed_forward_length",)},
     "lacks 'ernie4_5-moe.expert_feed_forward_length'"),
    ("ernie", {}, {"keys": {"expert_used_count": 9}},
     r"ernie4_5-moe\.expert_count 8 / expert_used_count 9"),
    ("ernie", {}, {"keys": {"interleave_moe_layer_step": 0}},
     r"ernie4_5-moe\.interleave_moe_layer_step 0"),
    ("ernie", {}, {"keys": {"expert_shared_feed_forward_length": 48}},
     r"ernie4_5-moe\.expert_shared_feed_forward_length 48 is not"),
    ("ernie", {}, {"drop_keys": ("expert_shared_feed_forward_length",)},
     r"ernie4_5-moe\.expert_shared_feed_forward_length 0 is not"),
    ("ernie", {}, {"keys": {"leading_dense_block_count": 0}},
     r"lacks 'blk\.0\.ffn_gate_inp\.weight' \(ernie4_5-moe's leading_dense_block_count"),
    ("ernie", {}, {"drop_tensors": ("exp_probs_b.bias",)},
     r"lacks 'blk\.1\.exp_probs_b\.bias'"),
    ("ernie", {"use_bias": True}, {}, r"'blk\.0\.attn_k\.bias': ernie4_5-moe files with"),
    ("hunyuan", {}, {"keys": {"expert_feed_forward_length": 64}},
     r"expert_shared_feed_forward_length 32 .* != hunyuan-moe\.expert_feed_forward_length 64"),
    ("hunyuan", {}, {"drop_keys": ("expert_feed_forward_length",)},
     "lacks 'hunyuan-moe.expert_feed_forward_length'"),
    ("hunyuan", {}, {"keys": {"expert_count": 0}}, r"hunyuan-moe\.expert_count 0"),
    ("hunyuan", {}, {"drop_tensors": ("ffn_up_shexp.weight",)},
     r"lacks 'blk\.0\.ffn_up_shexp\.weight'"),
    ("hunyuan", {"attention_bias": True}, {}, r"'blk\.0\.attn_k\.bias': hunyuan-moe files"),
    ("hunyuan", {}, {"keys": {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}},
     r"hunyuan-moe\.rope\.scaling\.type 'linear' \(factor 2\) is not supported"),
    ("ernie", {}, {"keys": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}},
     r"ernie4_5-moe\.rope\.scaling\.type 'yarn' \(factor 4\)"),
]


ERROR_IDS = ["ernie-no-step", "ernie-no-expert-size", "ernie-used-9-of-8", "ernie-step-0",
             "ernie-shared-width-48", "ernie-no-shared-width", "ernie-lead-0",
             "ernie-no-selection-bias", "ernie-biases", "hunyuan-expert-size-64",
             "hunyuan-no-expert-size", "hunyuan-no-experts", "hunyuan-no-shared-up",
             "hunyuan-biases", "hunyuan-linear-rope", "ernie-yarn-rope"]


@pytest.mark.parametrize(("family", "overrides", "written", "match"), ERRORS, ids=ERROR_IDS)
def test_gguf_metadata_errors_name_the_key(tmp_path: Path, family: str,
                                           overrides: dict[str, Any], written: dict[str, Any],
                                           match: str) -> None:
    hf = (ernie_moe_model if family == "ernie" else hunyuan_moe_model)(VOCAB, **overrides)
    path = tmp_path / "bad.gguf"
    write_moe_gguf(path, hf, **written)
    with pytest.raises(ModelLoadError, match=match):
        gguf_served(path)
