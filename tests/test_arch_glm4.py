"""GLM-4 (``Glm4ForCausalLM`` directories, ``glm4`` GGUF files), exact against transformers:
greedy tokens and every position's logits.

Its differences from Llama, each of which moves the logits when left out: the norms of the
attention's and the MLP's outputs, biases on q/k/v, and RoPE on half of each head on
adjacent pairs (2i, 2i + 1) - the rotary pairing is the trap: a half-offset rotation of the
same weights gives fluent-looking garbage without an error. The directory is a tiny random
model saved by transformers; the GGUF file is written as llama.cpp's converter writes GLM-4
(q/k/v apart with biases, gate and up in one ``ffn_up``, the weights unpermuted), its
reference transformers' model built from gguf-py's dequantization (transformers' GGUF
loader does not read glm4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q4_0, Q4_1, Q5_0, Q8_0, write_gguf
from gguf_reference import hf_glm4_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import Glm4Config, Glm4ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.glm4 import interleaved_head_order

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_logits_match(llm, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks), and without the
    norms of the attention's or the MLP's outputs they differ."""
    model, want = matching_logits(llm, ids, ref)
    for name in ("post_self_attn_norm", "post_mlp_norm"):
        saved = [getattr(layer, name) for layer in model.layers]
        try:
            for layer in model.layers:
                setattr(layer, name, torch.ones_like(getattr(layer, name)))
            assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05, name
        finally:
            for layer, value in zip(model.layers, saved):
                setattr(layer, name, value)


def test_interleaved_head_order_pairs_adjacent_dimensions_at_half_the_head() -> None:
    order = interleaved_head_order(16, 8)
    assert sorted(order.tolist()) == list(range(16))
    # New pairs (i, i + 8): GLM's rotated pairs (2i, 2i + 1) for i < 4, passed ones after.
    assert [(order[i].item(), order[i + 8].item()) for i in range(8)] == [
        (0, 1), (2, 3), (4, 5), (6, 7), (8, 12), (9, 13), (10, 14), (11, 15)]


def test_glm4_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "glm4", Glm4Config, Glm4ForCausalLM, head_dim=32, num_hidden_layers=3,
        partial_rotary_factor=0.5)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.partial_rotary_factor, cfg.attention_bias) == (
        "glm4", 0.5, True)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize("tied", [True, False])
def test_glm4_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    path = write_gguf(tmp_path / "glm4.gguf", "glm4", hidden=64, layers=3, heads=4,
                      kv_heads=2, head_dim=32, rope_dims=16, ff=96, tied=tied, seed=4,
                      weight_type=Q8_0, rope_theta=10000.0,
                      types={"ffn_up.weight": Q5_0, "attn_output.weight": Q4_0,
                             "token_embd.weight": Q4_1 if tied else Q8_0})
    hf = hf_glm4_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "glm4" and model.config.partial_rotary_factor == 0.5
    assert model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize(("metadata", "message"), [
    ({"rope.dimension_sections": 8}, "dimension_sections.*M-RoPE"),
    ({"nextn_predict_layers": 1}, "nextn_predict_layers.*not supported"),
])
def test_glm4_files_this_text_model_does_not_run_are_refused(tmp_path: Path, metadata: dict,
                                                               message: str) -> None:
    path = write_gguf(tmp_path / "glm4.gguf", "glm4", head_dim=32, rope_dims=16, seed=1,
                      metadata=metadata)
    with pytest.raises(ModelLoadError, match=message):
        convert_gguf(path, tmp_path / "out", progress=False)
