"""Gemma 4 (text: ``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration`` directories,
``gemma4`` GGUF files), exact against transformers: greedy tokens and every position's
logits, over the paged cache in chunks.

Three tiny random shapes, each with sliding layers (a window of 8 keys: the long prompt's
queries see a part of it) beside global ones whose heads are twice as wide:
- 31B-like: the global layers with one KV head whose values are the key projection's
  output (``attention_k_eq_v``), the final logits softcapped;
- E2B-like: per-layer embeddings, the last two layers' keys and values those of earlier
  layers (``num_kv_shared_layers``), their MLPs twice as wide;
- 26B-A4B-like: experts beside every layer's dense MLP.
The GGUF files are written as llama.cpp's converter writes them (tests/gguf_gemma4_files.py);
their reference is transformers' model holding the file's weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_gemma4_files import gemma4_model, write_gemma4_gguf
from test_arch_gemma3 import chunked_logits, engine_path
from test_arch_phi3 import save_model
from test_gguf_rope_factors import LONG, greedy, served
from tiny_models import build_tokenizer
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from freetoken_core import LLM
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gemma4 import Gemma4ForCausalLM
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.kv_layout import kv_cache_dims, kv_sources, layer_caches
from freetoken_core.models.sharding import Shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPES: dict[str, dict[str, Any]] = {
    "31b-like": {"layer_types": TYPES, "attention_k_eq_v": True,
                 "num_global_key_value_heads": 1, "final_logit_softcapping": 30.0},
    "e2b-like": {"num_hidden_layers": 5, "layer_types": [TYPES[0], *TYPES],
                 "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                 "hidden_size_per_layer_input": 32},
    "26b-a4b-like": {"layer_types": TYPES, "enable_moe_block": True, "num_experts": 4,
                     "top_k_experts": 2, "moe_intermediate_size": 32},
}


def per_layer_vocab(shape: str, vocab: int) -> dict[str, Any]:
    return {"vocab_size_per_layer_input": vocab} if shape == "e2b-like" else {}


def assert_matches(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]],
                   got: list[list[int]]) -> Any:
    """Greedy tokens and every position's logits of the long prompt (in two chunks) equal
    ``hf``'s; returns the served model."""
    assert got == greedy(hf, prompts, 16)
    model = llm.engine.core.runner.model
    ids = prompts[-1]
    half = len(ids) // 2
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(model, ids, [half, len(ids) - half]), want,
                               atol=2e-4, rtol=1e-4)
    assert len(set(got[-1])) > 3  # (the generation is not one token over and over)
    return model


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemma4_directory_matches_transformers(tmp_path: Path, shape: str, path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    tok = build_tokenizer(tmp_path)
    hf = gemma4_model(len(tok), **SHAPES[shape], **per_layer_vocab(shape, len(tok)))
    save_model(hf, tmp_path)
    llm, prompts, got = served(tmp_path, PROMPTS, 16)
    model = assert_matches(llm, hf, prompts, got)
    assert model.native is native
    cfg = model.config
    assert cfg.architecture == "gemma4" and max(cfg.layer_head_dims) == 32
    if shape == "31b-like":
        assert cfg.layer_kv_heads == (2, 1, 2, 1) and cfg.values_from_keys == (0, 1, 0, 1)
        assert model.layers[1].qkv_proj.out_features == 4 * 32 + 32  # (q and k: no v)
    if shape == "e2b-like":
        assert kv_sources(cfg) == (0, 1, 2, 1, 2) and kv_cache_dims(cfg) == (3, 1, 2 * 32)


def test_gemma4_conditional_generation_directory_serves_its_language_model(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path)
    text = gemma4_model(len(tok), **SHAPES["31b-like"])
    config = Gemma4Config(text_config=text.config.to_dict(), vision_config=None,
                          audio_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    wrapped = Gemma4ForConditionalGeneration(config).float().eval()
    missing, unexpected = wrapped.model.language_model.load_state_dict(
        text.model.state_dict(), strict=False)
    assert not unexpected and all("embed_scale" in k or "inv_freq" in k for k in missing)
    save_model(wrapped, tmp_path)
    assert any(k.startswith("model.language_model.") for k in wrapped.state_dict())
    llm, prompts, got = served(tmp_path, PROMPTS, 16)
    assert llm.engine.core.runner.model.config.text_of == "Gemma4ForConditionalGeneration"
    assert_matches(llm, text, prompts, got)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemma4_gguf_matches_transformers(tmp_path: Path, shape: str) -> None:
    from freetoken_core.models.resolve import default_gguf_path

    vocab = 49152  # (the default model's vocabulary, which the file takes)
    assert default_gguf_path().exists()
    hf = write_gemma4_gguf(tmp_path / "gemma4.gguf",
                           gemma4_model(vocab, seed=3, **SHAPES[shape],
                                        **per_layer_vocab(shape, vocab)))
    llm, prompts, got = served(tmp_path / "gemma4.gguf", PROMPTS, 16)
    model = assert_matches(llm, hf, prompts, got)
    assert model.uses_gguf_blocks and model.config.rope_scaling["rope_type"] == "factors"
    if shape == "26b-a4b-like" and model.native:  # (the experts in one native call)
        assert all(layer.moe.native_args is not None for layer in model.layers)


def test_gemma4_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    vocab = 49152
    hf = gemma4_model(vocab, **SHAPES["e2b-like"], **per_layer_vocab("e2b-like", vocab))
    path = tmp_path / "gemma4.gguf"
    write_gemma4_gguf(path, hf)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
        {**hf.config.to_dict(), "architectures": ["Gemma4ForCausalLM"]})
    for name in ("layer_windows", "layer_head_dims", "layer_kv_heads", "values_from_keys",
                 "kv_shared_layers", "per_layer_input_size", "rope_local_theta", "rope_theta",
                 "head_dim", "num_kv_heads", "final_logit_softcap", "query_scale"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rope_scaling["factors"][:4] == [1.0] * 4
    assert from_file.rope_scaling["factors"][4:] == [float(np.float32(1e30))] * 12  # (16 pairs)


def test_gemma4_kv_layout_views() -> None:
    base = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
            "layer_types": [TYPES[0], *TYPES], "num_kv_shared_layers": 2}
    cfg = ModelConfig.from_dict(base)
    assert kv_sources(cfg) == (0, 1, 2, 1, 2)
    layers, heads, width = kv_cache_dims(cfg)
    assert (layers, heads, width) == (3, 1, 2 * 32)  # (a global layer: 2 KV heads of 32)
    cache = torch.zeros(layers, 12, 2, heads, width)
    views = layer_caches(cfg, cache)
    sliding, full = (12, 2, 2, 16), (12, 2, 2, 32)
    assert [tuple(v.shape) for v in views] == [sliding, sliding, full, sliding, full]
    assert views[3] is views[1] and views[4] is views[2]
    assert all(v.is_contiguous() for v in views)
    # (a sliding layer's slot 5, its value, head 1: in the first part of its cache layer)
    views[0][5, 1, 1, 3] = 7.0
    assert cache.view(-1).nonzero().tolist() == [[5 * 2 * 2 * 16 + 2 * 16 + 16 + 3]]
    uniform = ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 4 + [
        "full_attention"], "global_head_dim": 16, "num_kv_shared_layers": 0})
    assert kv_cache_dims(uniform) == (5, 2, 16)


def test_gemma4_config_defaults_and_errors() -> None:
    base = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 7}
    cfg = ModelConfig.from_dict(base)
    # transformers' defaults: 8 heads of 256 / 4 KV heads; every 6th layer global and the
    # last; global heads of 512, proportional rope (a quarter of the pairs) of base 1e6
    assert (cfg.num_heads, cfg.head_dim, cfg.num_kv_heads) == (8, 256, 4)
    assert cfg.layer_windows == (512,) * 5 + (None, None)
    assert cfg.layer_head_dims == (256,) * 5 + (512, 512)
    assert cfg.rope_scaling == {"rope_type": "proportional", "factor": 1.0,
                                "partial_rotary_factor": 0.25}
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_scale) == (1e6, 1e4, 1.0)
    assert cfg.per_layer_input_size == 256 and cfg.tie_word_embeddings
    for bad, match in (({"use_bidirectional_attention": "all"}, "encoder"),
                       ({"attention_bias": True}, "attention_bias"),
                       ({"num_kv_shared_layers": 7}, "num_kv_shared_layers"),
                       ({"enable_moe_block": True, "num_experts": 4}, "top_k_experts"),
                       ({"per_layer_config": {"9": {"head_dim": 8}}}, "per_layer_config"),
                       ({"per_layer_config": {"1": {"sliding_window": 8}}}, "sliding_window"),
                       ({"hidden_activation": "silu"}, "gelu_pytorch_tanh"),
                       ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}},
                        "yarn")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})


def test_gemma4_refuses_tensor_parallelism() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64,
                                 "hidden_size": 64, "intermediate_size": 64,
                                 "num_hidden_layers": 2})
    with pytest.raises(ModelLoadError, match="tensor parallelism of Gemma 4"):
        Gemma4ForCausalLM(cfg, {}, 64, shard=Shard(0, 2, None))


def test_gemma4_gguf_served_with_its_tokenizer_template_and_plugins(tmp_path: Path) -> None:
    """A Gemma 4 file as people download it: the ``gemma4`` tokenizer, Gemma 4's own chat
    template, served by ``freetoken serve`` with the reasoning and tool-call plugins, which
    find Gemma 4's markers themselves: a chat request with tools renders, runs and answers
    (a random model's text; the split and the parse are tests/test_gemma4*.py's)."""
    from gguf_gemma4 import gemma4_fields, gemma4_vocab
    from server_fixtures import ok, start_server, stop_server

    template = (Path(__file__).parent / "fixtures" / "gemma4"
                / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    fields, _ = gemma4_fields("lines")
    tokens = gemma4_vocab("lines")[0]
    hf = gemma4_model(len(tokens), **SHAPES["e2b-like"], **per_layer_vocab("e2b-like",
                                                                          len(tokens)))
    path = tmp_path / "gemma-4-e2b-like.gguf"
    write_gemma4_gguf(path, hf, tokenizer_fields=fields, chat_template=template)
    srv = start_server(path, "--plugins", "reasoning,tool_calls",
                       log_file=tmp_path / "serve.log")
    try:
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        body = ok(srv, "/v1/chat/completions", {"model": srv.model, "messages": messages,
                                                "tools": tools, "max_tokens": 8})
        assert body["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
        plain = ok(srv, "/v1/chat/completions", {"model": srv.model, "messages": messages,
                                                 "max_tokens": 8})
        ids = ok(srv, "/tokenize", {"model": srv.model, "messages": messages})["tokens"]
        assert ids[0] == 2 and plain["usage"]["prompt_tokens"] == len(ids)  # (<bos> first)
        assert tokens.index("<|turn>") in ids
        # the tools' declarations, Gemma's <|"|> strings among them, make the prompt longer
        assert body["usage"]["prompt_tokens"] > len(ids) + 10
    finally:
        stop_server(srv)
