"""DeepSeek GGUF files (``deepseek2``: DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.7-Flash) as
llama.cpp's converter writes them (tests/gguf_deepseek2_files.py), exact against
transformers holding the file's weights: greedy tokens and every position's logits. A V3-like
file (queries through ``q_lora_rank``, YaRN, sigmoid routing among groups with a selection
bias, a multi-token-prediction layer not read, ``kv_b`` split per head and kept as GGUF
blocks a head) in two block types and on both engine paths; a V2-like file (softmax routing,
queries from ``attn_q``) and an older file's unsplit ``attn_kv_b``. The metadata errors name
their key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_deepseek2_files import deepseek_model, write_deepseek2_gguf
from gguf_glm4moe_files import mtp_layer
from test_arch_gemma3 import chunked_logits, engine_path
from test_arch_glm4_moe import gguf_served
from test_arch_qwen3_5 import assert_matches
from test_gguf_rope_factors import LONG

from freetoken_core import LLM
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the files take)


@pytest.mark.parametrize(("path", "weight_type"), [
    ("native", GGMLQuantizationType.Q8_0), ("native", GGMLQuantizationType.Q4_0),
    ("torch", GGMLQuantizationType.Q8_0)])
def test_deepseek_v3_gguf_matches_transformers(tmp_path: Path, path: str, weight_type: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = deepseek_model(VOCAB, seed=3)
    file = tmp_path / "deepseek2.gguf"
    hf = write_deepseek2_gguf(file, hf, mtp_layer(hf), weight_type=weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.uses_gguf_blocks and model.native is native
    assert cfg.architecture == "deepseek_v3" and cfg.num_layers == 3 and len(model.layers) == 3
    assert cfg.mla_shape == (32, 32, 32, 8, 16) and cfg.rope_interleaved
    attn = model.layers[0].attn
    assert attn.k_b is not None and len(attn.k_b) == len(attn.v_b) == 4  # (a linear a head)
    assert [layer.moe is None for layer in model.layers] == [True, False, False]
    assert_matches(llm, hf, 5, [[70]])


def test_the_heads_in_one_native_call_compute_what_a_call_a_head_computes(
        tmp_path: Path) -> None:
    """A split ``kv_b``'s per-head linears run in one ``gguf_linear_heads`` call: every
    logit of a prompt fed in chunks of 70 rows (a head at a time, its features shared among
    the threads), of the rest but three (the heads side by side on two threads) and then
    token by token (one row), on one thread and on two, the same to the bit as one linear
    call a head, in the exact and the q8 arithmetic."""
    hf = deepseek_model(VOCAB, seed=3)
    file = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(file, hf, weight_type=GGMLQuantizationType.Q8_0)
    for activations in ("auto", "q8"):
        llm = LLM(str(file), kv_cache_tokens=1024, dtype="float32", progress=False,
                  plugins="none", activations=activations)
        model = llm.engine.core.runner.model
        ids = llm.tokenizer.encode(" ".join([LONG] * 3), add_special_tokens=False)
        chunks = [70, len(ids) - 73, 1, 1, 1]
        assert 1 < chunks[1] < 64  # (gguf_heads.cpp's kSharedRows)
        heads = [h for layer in model.layers for h in (layer.attn.k_b, layer.attn.v_b)]
        assert all(h is not None and h.one_call for h in heads)
        for h in heads:
            h.one_call = False
        a_call_a_head = chunked_logits(model, ids, chunks)
        for h in heads:
            h.one_call = True
        for threads in (1, 2):
            torch.set_num_threads(threads)  # (one_torch_thread sets it back)
            assert torch.equal(chunked_logits(model, ids, chunks), a_call_a_head), threads


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek_v2_gguf_matches_transformers(tmp_path: Path, split_kv_b: bool) -> None:
    hf = deepseek_model(VOCAB, v3=False, seed=4)
    file = tmp_path / "deepseek2.gguf"
    hf = write_deepseek2_gguf(file, hf, split_kv_b=split_kv_b)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert cfg.architecture == "deepseek_v2" and cfg.mla_shape == (0, 32, 32, 8, 16)
    assert cfg.expert_gating == "softmax" and cfg.expert_groups == (1, 1)
    assert (model.layers[0].attn.k_b is not None) is split_kv_b
    assert_matches(llm, hf, 5, [[70]])


def test_deepseek2_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    hf = deepseek_model(VOCAB)
    path = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(path, hf, mtp_layer(hf))
    config = build_config(open_header(path))
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3, 1)
    from_file = ModelConfig.from_dict(config)
    from_hf = ModelConfig.from_dict({**hf.config.to_dict(),
                                     "architectures": ["DeepseekV3ForCausalLM"]})
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "mla_shape", "rope_interleaved", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "expert_gating",
                 "expert_selection_bias", "expert_groups", "expert_norm_eps",
                 "norm_topk_prob", "moe_layers", "intermediate_size", "vocab_size"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    for name in ("rms_norm_eps", "query_scale", "routed_scaling_factor"):
        assert getattr(from_file, name) == pytest.approx(getattr(from_hf, name)), name
    scaling = {k: v for k, v in from_file.rope_scaling.items() if k not in ("rope_theta",)}
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    assert scaling["mscale_all_dim"] == pytest.approx(1.0)


@pytest.mark.parametrize(("drop", "keys", "match"), [
    (("attention.kv_lora_rank",), {}, "lacks 'deepseek2.attention.kv_lora_rank'"),
    (("expert_shared_count",), {}, "lacks 'deepseek2.expert_shared_count'"),
    ((), {"expert_gating_func": 3}, r"deepseek2\.expert_gating_func 3"),
    ((), {"nextn_predict_layers": 4}, r"deepseek2\.nextn_predict_layers 4"),
    ((), {"rope.dimension_count": 7}, r"deepseek2\.rope\.dimension_count 7"),
    ((), {"rope.scaling.type": "linear"}, r"deepseek2\.rope\.scaling\.type 'linear'"),
])
def test_deepseek2_gguf_metadata_errors_name_the_key(tmp_path: Path, drop: tuple[str, ...],
                                                     keys: dict[str, Any], match: str) -> None:
    hf = deepseek_model(VOCAB)
    path = tmp_path / "bad.gguf"
    write_deepseek2_gguf(path, hf, mtp_layer(hf), drop_keys=drop, keys=keys)
    with pytest.raises(ModelLoadError, match=match):
        gguf_served(path)


def test_deepseek2_gguf_head_shapes_are_checked(tmp_path: Path) -> None:
    hf = deepseek_model(VOCAB)
    path = tmp_path / "bad.gguf"  # (the heads' value length says 8, the tensors hold 16)
    write_deepseek2_gguf(path, hf, keys={"attention.value_length_mla": 8})
    with pytest.raises(ModelLoadError, match=r"v_b_proj has heads of shape \[16, 32\]"):
        gguf_served(path)
