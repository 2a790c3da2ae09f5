"""ERNIE 4.5 dense (``Ernie4_5ForCausalLM`` directories, ``ernie4_5`` GGUF files), exact
against transformers: greedy tokens and every position's logits.

Its differences from Llama: RoPE over the whole head on adjacent pairs (2i, 2i + 1) - the
trap: a half-offset rotation of the same weights gives fluent-looking garbage without an
error, so a test takes FreeToken's reordering of the q/k rows out and sees the logits move
- biases on every linear but the head where ``use_bias``, and transformers' own config
defaults (head_dim 128, two KV heads, rope base 500,000, tied embeddings). The directory is
a tiny random model saved by transformers; the GGUF file is written as llama.cpp's converter
writes ERNIE 4.5 (q/k/v and gate/up apart, the q/k rows unpermuted: its ``Ernie4_5Model`` is
a ``TextModel``, not a ``LlamaModel``), its reference transformers' model built from
gguf-py's dequantization (transformers' GGUF loader does not read ernie4_5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q4_0, Q4_1, Q5_0, Q8_0, write_gguf
from gguf_reference_families import hf_ernie4_5_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from test_tensor_parallel import _check_tp_equals_one_rank
from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models import ernie4_5
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.glm4 import interleaved_head_order

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
SHAPE = {"head_dim": 32, "num_hidden_layers": 3}


def test_the_whole_head_rotates_on_adjacent_pairs() -> None:
    # New half-offset pairs (i, i + 4) are ERNIE's adjacent pairs (2i, 2i + 1).
    assert interleaved_head_order(8, 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_left_out_keys_take_transformers_defaults() -> None:
    keys = {"vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = ModelConfig.from_dict({"architectures": ["Ernie4_5ForCausalLM"], **keys})
    hf = Ernie4_5Config(**keys)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps,
            cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.attention_bias,
            cfg.bos_token_id, cfg.eos_token_ids) == (
        hf.head_dim, hf.num_key_value_heads, hf.rope_parameters["rope_theta"],
        hf.rms_norm_eps, hf.max_position_embeddings, hf.tie_word_embeddings, hf.use_bias,
        hf.bos_token_id, (hf.eos_token_id,)) == (
        128, 2, 500_000.0, 1e-5, 131072, True, False, 1, (2,))


def test_scaled_rope_and_an_expertless_moe_file_are_refused(tmp_path: Path) -> None:
    keys = {"architectures": ["Ernie4_5ForCausalLM"], "vocab_size": 100, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    for arch in ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"):  # (the MoE's directories
        with pytest.raises(ModelLoadError, match="rope type 'linear' is not supported"):
            ModelConfig.from_dict({**keys, "architectures": [arch]})  # are served: their rope
    # (ernie4_5-moe files are served: tests/test_arch_ernie_hunyuan_moe_gguf.py; a dense
    # file under its name has no experts)
    path = write_gguf(tmp_path / "moe.gguf", "ernie4_5", file_arch="ernie4_5-moe")
    with pytest.raises(ModelLoadError, match=r"ernie4_5-moe\.expert_count 0"):
        convert_gguf(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize(("use_bias", "tied"), [(False, True), (True, False)])
def test_ernie4_5_directory_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 use_bias: bool, tied: bool) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "ernie", Ernie4_5Config, Ernie4_5ForCausalLM, use_bias=use_bias,
        tie_word_embeddings=tied, **SHAPE)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert (cfg.architecture, cfg.head_dim, cfg.attention_bias, cfg.tie_word_embeddings,
            cfg.rope_theta) == ("ernie4_5", 32, use_bias, tied, 500_000.0)
    assert (model.layers[0].down_proj.bias is not None) == use_bias
    assert got == greedy(hf, prompts, 16)
    _, want = matching_logits(llm, prompts[-1], hf)
    llm.close()
    # Without the reordering Llama's half-offset rotation turns other pairs: other logits.
    monkeypatch.setattr(ernie4_5, "interleaved_head_order", lambda d, rot: torch.arange(d))
    unordered, _, _ = served(tmp_path / "ernie", PROMPTS[:1], 1)
    other = chunked_logits(unordered.engine.core.runner.model, prompts[-1], [len(prompts[-1])])
    unordered.close()
    assert (other - want).abs().max() > 0.05


@pytest.mark.parametrize(("tied", "biases"), [(True, False), (False, True)])
def test_ernie4_5_gguf_matches_transformers(tmp_path: Path, tied: bool, biases: bool) -> None:
    path = write_gguf(tmp_path / "ernie.gguf", "ernie4_5", hidden=64, layers=3, heads=4,
                      kv_heads=2, head_dim=32, ff=96, tied=tied, seed=5, weight_type=Q8_0,
                      rope_theta=500_000.0, biases=biases,
                      types={"ffn_up.weight": Q5_0, "attn_output.weight": Q4_0,
                             "token_embd.weight": Q4_1 if tied else Q8_0})
    hf = hf_ernie4_5_from_gguf(path)
    assert hf.config.use_bias == biases
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "ernie4_5" and model.uses_gguf_blocks
    # (without biases each block decodes in the one native call, on the reordered rows)
    assert all(layer.one_call is not None for layer in model.layers) == (not biases)
    assert got == greedy(hf, prompts, 16)
    matching_logits(llm, prompts[-1], hf)


def test_biases_split_for_tensor_parallelism(tmp_path: Path) -> None:
    """Every linear's bias (the MLP's too) on two ranks: gate/up's split with their rows,
    down's and o's added once to the all-reduced sum."""
    model_dir = save_tiny_model(tmp_path / "ernie", Ernie4_5Config, Ernie4_5ForCausalLM,
                                use_bias=True, **SHAPE)
    _check_tp_equals_one_rank(str(model_dir), dtype="float32")
