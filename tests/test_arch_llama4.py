"""Llama 4 (``Llama4ForCausalLM`` and ``Llama4ForConditionalGeneration`` directories, ``llama4``
GGUF files), exact against transformers: greedy tokens and every position's logits, the
prompt fed whole and in chunks, on the native and the torch paths. A tiny random Llama 4
(tests/gguf_llama4_files.py): dense and MoE layers in turn (the experts' inputs scaled by the
sigmoid of their router logit, a shared expert), RoPE on adjacent pairs on three layers in
four, the 4th NoPE with the attention temperature (in steps of 16 positions here), q/k L2
norms on the rotating layers, chunked attention over 22 positions on them (prompts of up to
150 tokens: several chunks), Scout's llama3 rope scaling. The config's defaults are
transformers'; its errors and the GGUF files' metadata errors name their key. And the
chunked attention itself (attention.py's masks, the native kernel's ``attention_chunk``)
against its definition."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_llama4_files import llama4_model, write_llama4_gguf
from test_arch_gemma3 import (
    assert_chunks_match,
    engine_path,
    paged_case,
    reference_attention,
)
from test_arch_phi3 import save_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from tiny_models import build_tokenizer
from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig

from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the GGUF files take)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama4")
    return save_model(llama4_model(len(build_tokenizer(out))), out)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_llama4_directory_matches_transformers(model_dir: Path, path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Llama4ForCausalLM

    native, _ = engine_path(path, monkeypatch)
    hf = Llama4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.native is native and cfg.architecture == "llama4"
    assert cfg.moe_layers == (0, 1, 0, 1) and cfg.no_rope_layers == (1, 1, 1, 0)
    assert model.chunks == [22, 22, 22, None] and cfg.attention_temperature_length == 16
    assert [layer.q_norm is not None for layer in model.layers] == [True, True, True, False]
    assert_matches(llm, hf, 7, [[], [1, 1, 70], [22, 40], [64, 64]])


def test_llama4_conditional_generation_directory_serves_its_language_model(
        tmp_path: Path) -> None:
    # Maverick-like: no q/k norms, two experts a token, the default rope; NoPE on the 3rd
    # layer (no_rope_layers given), the 2nd layer's attention full (layer_types given)
    text = llama4_model(len(build_tokenizer(tmp_path)), seed=1, use_qk_norm=False,
                        num_experts_per_tok=2, attention_chunk_size=16,
                        no_rope_layers=[1, 1, 0, 1], rope_parameters={
                            "rope_type": "default", "rope_theta": 500000.0},
                        layer_types=["chunked_attention", "full_attention",
                                     "full_attention", "chunked_attention"])
    config = Llama4Config(text_config=text.config.to_dict(), vision_config={
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "image_size": 28, "patch_size": 14,
        "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32})
    config.architectures = ["Llama4ForConditionalGeneration"]
    wrapped = Llama4ForConditionalGeneration(config).float().eval()
    missing, unexpected = wrapped.language_model.load_state_dict(text.state_dict(),
                                                                  strict=False)
    assert not missing and not unexpected
    save_model(wrapped, tmp_path)
    llm = served(tmp_path)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert cfg.text_of == "Llama4ForConditionalGeneration" and not cfg.qk_norm
    assert model.chunks == [16, None, None, 16] and cfg.num_experts_per_tok == 2
    assert_matches(llm, text, 5, [[40]])


def test_llama4_config_defaults_are_transformers() -> None:
    shape = {"num_hidden_layers": 8, "hidden_size": 2048, "num_attention_heads": 32}
    for given in (shape, {**shape, "attention_chunk_size": None, "no_rope_layer_interval": 3,
                          "interleave_moe_layer_step": 4}):
        hf = Llama4TextConfig(**given)
        for cfg in (ModelConfig.from_dict({"architectures": ["Llama4ForCausalLM"], **given}),
                    ModelConfig.from_dict({"architectures": ["Llama4ForConditionalGeneration"],
                                           "text_config": given})):
            assert cfg.architecture == "llama4" and cfg.head_dim == hf.head_dim
            assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
                hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                hf.vocab_size)
            assert (cfg.intermediate_size, cfg.moe_intermediate_size,
                    cfg.shared_expert_intermediate_size) == (
                hf.intermediate_size_mlp, hf.intermediate_size, hf.intermediate_size)
            assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf.num_local_experts,
                                                                  hf.num_experts_per_tok)
            assert cfg.moe_layers == tuple(int(i in hf.moe_layers) for i in range(8))
            assert cfg.no_rope_layers == tuple(hf.no_rope_layers)
            assert cfg.layer_chunks == tuple(hf.attention_chunk_size or 0 if t ==
                                             "chunked_attention" else 0
                                             for t in hf.layer_types)
            assert cfg.qk_norm is hf.use_qk_norm and cfg.rms_norm_eps == hf.rms_norm_eps
            assert (cfg.attention_temperature_beta, cfg.attention_temperature_length) == (
                hf.attn_scale, hf.floor_scale)
            assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
            assert cfg.rope_scaling is None and not cfg.tie_word_embeddings
            assert cfg.eos_token_ids == (hf.eos_token_id,)
    assert ModelConfig.from_dict({"architectures": ["Llama4ForCausalLM"],
                                  "attn_temperature_tuning": False}
                                 ).attention_temperature_beta == 0.0


@pytest.mark.parametrize(("bad", "match"), [
    ({"num_experts_per_tok": 17}, "num_experts_per_tok 17 exceeds"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),
    ({"moe_layers": [1, 9]}, "moe_layers"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
     "attention_chunk_size is None"),
    ({"attention_chunk_size": 0}, "attention_chunk_size"),
    ({"floor_scale": 0}, "floor_scale"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "silu"),
])
def test_llama4_config_errors_name_the_key(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({"architectures": ["Llama4ForCausalLM"],
                               "num_hidden_layers": 4, **bad})


# ---------------------------------------------------------------------------------------------
# Chunked attention (attention.py's masks, the native kernel's attention_chunk)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 16, 22, 64, 500])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_attention_matches_the_definition(chunk: int, block_size: int) -> None:
    tables, lens, query_lens, cache, q, kv, written = paged_case(block_size, chunk)
    ref = reference_attention(q, written, tables, lens, query_lens, block_size,
                              lambda pos: pos // chunk * chunk, 0.3)
    paths = [True, False] if cpu_kernels_available() else [False]
    for native in paths:
        meta = AttentionMetadata.build(tables, lens, query_lens, block_size,
                                       torch.device("cpu"), native=native)
        # (a sliding window's metadata first: the chunk replaces it)
        out = paged_attention(q, kv, cache.clone(), meta.with_window(9).with_chunk(chunk), 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"native={native}")
    with pytest.raises(ValueError, match="at least one position"):
        meta.with_chunk(0)


# ---------------------------------------------------------------------------------------------
# GGUF files (llama4) as llama.cpp's converter writes them (tests/gguf_llama4_files.py), with
# the default model's vocabulary: Scout-like (16 experts, every layer's MLP experts, q/k norms,
# llama3 rope as rope_freqs.weight) and Maverick-like (128 experts: no q/k norms, dense and
# MoE layers in turn, the default rope). llama.cpp fixes the chunks and the temperature's steps
# at 8192 positions, so the reference holds those.
# ---------------------------------------------------------------------------------------------
GGUF_SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    "scout-like": ({"num_local_experts": 16, "interleave_moe_layer_step": 1},
                   GGMLQuantizationType.Q8_0),
    "maverick-like": ({"num_local_experts": 128, "use_qk_norm": False,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                      GGMLQuantizationType.Q4_0),
}
LLAMA_CPP = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1}


def gguf_served(path: Path) -> Any:
    """``path`` served, its config built afresh (the files here are the same bytes at every
    run: a conversion cached by an earlier run would stand in for the metadata's reading)."""
    from freetoken_core.models.resolve import converted_dir, default_gguf_path

    assert default_gguf_path().exists()
    shutil.rmtree(converted_dir(path), ignore_errors=True)
    return served(path)


@pytest.mark.parametrize(("shape", "path"), [("scout-like", "native"),
                                             ("maverick-like", "native"),
                                             ("scout-like", "torch")])
def test_llama4_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    overrides, weight_type = GGUF_SHAPES[shape]
    file = tmp_path / "llama4.gguf"
    hf = write_llama4_gguf(file, llama4_model(VOCAB, seed=3, **LLAMA_CPP, **overrides),
                           weight_type=weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert model.uses_gguf_blocks and cfg.architecture == "llama4" and model.native is native
    assert cfg.qk_norm is hf.config.use_qk_norm and cfg.num_experts == len(
        hf.model.layers[1].feed_forward.experts.gate_up_proj)
    assert cfg.moe_layers == tuple(int(i in hf.config.moe_layers) for i in range(4))
    assert cfg.layer_chunks == (8192, 8192, 8192, 0)
    assert (cfg.rope_scaling or {}).get("rope_type") == (
        "factors" if shape == "scout-like" else None)
    assert all((layer.moe.native_args is not None) is native  # (one native call)
               for layer in model.layers if layer.moe is not None)
    prompts = prompts_of(llm, 5)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)
    ids = prompts[1]
    assert_chunks_match(model, hf, ids, [70, len(ids) - 70])


def test_llama4_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    hf = llama4_model(VOCAB, **LLAMA_CPP)
    path = tmp_path / "llama4.gguf"
    write_llama4_gguf(path, hf)
    from_file = ModelConfig.from_dict(build_config(open_header(path)))
    from_hf = ModelConfig.from_dict(hf.config.to_dict())
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "qk_norm", "attention_bias", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "expert_gating",
                 "intermediate_size", "moe_layers", "no_rope_layers", "layer_chunks",
                 "attention_temperature_beta", "attention_temperature_length"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # (float32 in the file)


@pytest.mark.parametrize(("drop", "keys", "match"), [
    (("interleave_moe_layer_step",), {}, "lacks 'llama4.interleave_moe_layer_step'"),
    (("expert_feed_forward_length",), {}, "lacks 'llama4.expert_feed_forward_length'"),
    (("attention.layer_norm_rms_epsilon",), {},
     "lacks 'llama4.attention.layer_norm_rms_epsilon'"),
    ((), {"interleave_moe_layer_step": 0}, r"llama4\.interleave_moe_layer_step 0"),
    ((), {"expert_count": 0}, r"llama4\.expert_count 0"),
    ((), {"expert_used_count": 9}, r"llama4\.expert_count 4 / expert_used_count 9"),
    ((), {"attention.sliding_window": 0}, r"llama4\.attention\.sliding_window 0"),
    ((), {"attention.sliding_window": 4096}, r"llama4\.attention\.sliding_window 4096"),
    ((), {"rope.freq_base_swa": 10000.0}, r"llama4\.rope\.freq_base_swa 10000\.0"),
])
def test_llama4_gguf_metadata_errors_name_the_key(tmp_path: Path, drop: tuple[str, ...],
                                                  keys: dict[str, Any], match: str) -> None:
    path = tmp_path / "bad.gguf"
    write_llama4_gguf(path, llama4_model(VOCAB), drop_keys=drop, keys=keys)
    with pytest.raises(ModelLoadError, match=match):
        gguf_served(path)
