"""OLMo 2 and OLMo 3 (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM`` directories; ``olmo2`` GGUF
files, as llama.cpp's converter writes both), exact against transformers: greedy tokens and
every position's logits.

Their differences from Llama, each of which moves the logits when left out: norms after the
attention and the MLP instead of before, q and k normed over all heads at once, and OLMo
3's sliding-window layers (every 4th layer global; a window of 8 keys here, so the long
prompt's queries see a part of it) with their own unscaled rope beside the global layers'
YaRN. The directories are tiny random models saved by transformers; the GGUF files are
written as the converter writes them (no input norms, full-width q/k norms, the weights
unpermuted), their reference transformers' model built from gguf-py's dequantization
(transformers' GGUF loader does not read olmo2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_olmo_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.olmo2 import Olmo2ForCausalLM as NativeOlmo

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
OLMO3 = {"num_hidden_layers": 4, "sliding_window": 8, "rope_parameters": {
    "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "attention_factor": 1.2},
    "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}}


def assert_logits_match(llm: Any, ids: list[int], ref: torch.nn.Module,
                        windows: bool) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); with the q/k
    norms or (OLMo 3) the windows left out they differ."""
    model, want = matching_logits(llm, ids, ref)
    norms = [(layer.q_norm, layer.k_norm) for layer in model.layers]
    try:
        for layer in model.layers:
            layer.q_norm, layer.k_norm = (torch.ones_like(w) for w in (layer.q_norm,
                                                                        layer.k_norm))
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        for layer, (q, k) in zip(model.layers, norms):
            layer.q_norm, layer.k_norm = q, k
    if windows:
        saved = model.windows
        try:
            assert len(ids) > 4 * 8 and any(w is not None for w in saved)
            model.windows = [None] * len(saved)
            assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
        finally:
            model.windows = saved


def test_olmo2_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "olmo2", Olmo2Config,
                                             Olmo2ForCausalLM, num_hidden_layers=3,
                                             rope_theta=10000.0)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "olmo2" and cfg.qk_norm and not cfg.layer_windows
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, windows=False)


def test_olmo3_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "olmo3", Olmo3Config,
                                             Olmo3ForCausalLM, **OLMO3)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "olmo3" and cfg.layer_windows == (8, 8, 8, None)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_local_theta == 500000.0
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, windows=True)


@pytest.mark.parametrize("olmo3", [False, True], ids=["olmo2", "olmo3"])
def test_olmo_gguf_matches_transformers(tmp_path: Path, olmo3: bool) -> None:
    path = write_gguf(tmp_path / "olmo.gguf", "olmo2", hidden=64, layers=4, heads=4,
                      kv_heads=2, ff=96, tied=False, seed=8, weight_type=Q8_0,
                      rope_theta=10000.0, types={"attn_output.weight": Q4_0},
                      metadata={"attention.sliding_window": 8} if olmo3 else None)
    hf = hf_olmo_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == ("olmo3" if olmo3 else "olmo2")
    assert model.config.layer_windows == ((8, 8, 8, None) if olmo3 else ())
    assert model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, windows=olmo3)


@pytest.mark.parametrize(("pattern", "types"), [
    (None, ["sliding_attention"] * 3 + ["full_attention"]),
    (2, ["sliding_attention", "full_attention"] * 2),
    ([False, True, True, False], ["full_attention", "sliding_attention",
                                  "sliding_attention", "full_attention"]),
])
def test_olmo3_files_sliding_layers_as_llama_cpp_reads_them(tmp_path: Path, pattern: Any,
                                                            types: list[str]) -> None:
    """``attention.sliding_window_pattern``: absent (every 4th layer global), a period, or a
    flag a layer; ``rope.freq_base_swa``: the sliding layers' base."""
    import json

    from freetoken_core.models.gguf import convert_gguf

    metadata = {"attention.sliding_window": 8, "rope.freq_base_swa": 5000.0}
    if pattern is not None:
        metadata["attention.sliding_window_pattern"] = pattern
    path = write_gguf(tmp_path / "olmo3.gguf", "olmo2", layers=4, seed=1, metadata=metadata)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    assert config["architectures"] == ["Olmo3ForCausalLM"] and config["layer_types"] == types
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 5000.0


def test_tensor_parallelism_is_refused(tmp_path: Path) -> None:
    from freetoken_core.models.config import ModelConfig
    from freetoken_core.models.sharding import Shard

    cfg = ModelConfig.from_dict({"architectures": ["Olmo2ForCausalLM"], "vocab_size": 64,
                                 "hidden_size": 64, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 4})
    with pytest.raises(ModelLoadError, match="tensor parallelism of olmo2"):
        NativeOlmo(cfg, {}, 64, Shard.__new__(Shard))
