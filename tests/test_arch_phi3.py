"""Phi-3 against transformers' ``Phi3ForCausalLM``: fused qkv / gate_up weights, a sliding
window on every layer, a partial rotary factor and LongRoPE.

Three tiny random models: plain; ``sliding_window=7`` (transformers applies it to every
layer); and ``partial_rotary_factor=0.5`` with LongRoPE of pre-training length 48, run with
the context limited to it (the short factors) and not (the long ones, on prompts longer
than 48), with its attention factor. Logits of a prompt fed in chunks match transformers' to 1e-4 on both attention
paths, and greedy tokens of a batch of prompts equal transformers' ``generate``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_arch_gemma3 import PATHS, PROMPTS, build_native, chunked_logits, engine_path, hf_greedy
from tiny_models import build_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Phi3Config
from transformers import Phi3ForCausalLM as HFPhi3

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models import loader
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_weights import GGUFWeight
from freetoken_core.models.phi3 import Phi3ForCausalLM, head_order, reorder_rows, split_rows
from freetoken_core.models.registry import model_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL = 48
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window": {"sliding_window": 7},
    "partial-longrope": {
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {"rope_type": "longrope",
                         "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [2.0, 3.0, 5.0, 8.0]},
    },
}
LONG_PROMPT = ("Once upon a time there was a little robot who wanted to learn how to write "
               "stories. Every morning it read a book")
LONGER_PROMPT = (LONG_PROMPT + ", and every evening it wrote a short paragraph about what it "
                 "had learned. The robot's friends were a cat, a bird and an old computer.")


def make_phi3(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Phi-3 directory (hidden 64, 4 heads of 16, 2 KV heads, 2 layers) with
    O(1)-scale random weights, so greedy logits are well separated."""
    return save_tiny_model(out_dir, Phi3Config, HFPhi3, seed, **overrides)


def save_tiny_model(out_dir: Path, config_class: type, model_class: type, seed: int = 0,
                    **overrides: Any) -> Path:
    """A tiny ``model_class`` directory saved by transformers (hidden 64, 4 heads of 16, 2
    KV heads, 2 layers unless ``overrides`` say otherwise; tests/tiny_models.py's
    tokenizer) with O(1)-scale random weights, so greedy logits are well separated."""
    tok = build_tokenizer(out_dir)
    config = config_class(**{
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2, **overrides})
    config.architectures = [model_class.__name__]
    model = random_model(model_class, config, seed)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    return save_model(model, out_dir)


def random_model(model_class: type, config: Any, seed: int) -> Any:
    """``model_class(config)`` in float32 with O(1)-scale random weights: embeddings N(0, 1),
    norms U(0.9, 1.1), the rest N(0, 4 / fan-in)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=gen)
            elif "norm" in name:
                param.uniform_(0.9, 1.1, generator=gen)
            else:
                param.normal_(0.0, 2.0 / math.sqrt(param.shape[-1]), generator=gen)
    return model


def save_model(model: Any, out_dir: Path) -> Path:
    """``model`` saved at ``out_dir`` with the test tokenizer's special token ids."""
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(variant: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_phi3(tmp_path_factory.mktemp(f"phi3-{variant}"), **VARIANTS[variant])


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_reads_phi3(variant: str, model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "phi3" and model_class(cfg) is Phi3ForCausalLM
    assert cfg.head_dim == 16 and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert cfg.sliding_window is None  # the engine caps the context only for Mistral's
    assert cfg.layer_windows == ((7, 7) if variant == "window" else ())
    if variant == "partial-longrope":
        assert cfg.partial_rotary_factor == 0.5
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    else:
        assert cfg.partial_rotary_factor == 1.0 and cfg.rope_scaling is None


def test_config_reads_hub_style_longrope(tmp_path: Path) -> None:
    """Phi-3-mini-128k's config.json: rope_scaling of type "su" (LongRoPE's old name) and
    the pre-training length outside it."""
    data = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": 64,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "sliding_window": 262144, "rope_theta": 10000.0,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    cfg = ModelConfig.from_dict(data)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.layer_windows == (262144,)
    with pytest.raises(ModelLoadError, match="rope_scaling type 'dynamic' is not supported"):
        ModelConfig.from_dict({**data, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="hidden activation 'gelu_new' is not supported"):
        ModelConfig.from_dict({**data, "hidden_act": "gelu_new"})


def test_odd_rotary_dimensions_are_refused(model_dir: Path) -> None:
    cfg = dataclasses.replace(ModelConfig.from_dir(model_dir), rope_scaling=None)
    for factor, message in ((5 / 16, "rotates 5 of 16"), (0.0, "rotates 0 of 16")):
        weights = loader.read_weights(model_dir, torch.float32, torch.device("cpu"))
        with pytest.raises(ModelLoadError, match=message):
            Phi3ForCausalLM(dataclasses.replace(cfg, partial_rotary_factor=factor), weights, 64)


def test_head_order_pairs_rotated_dimensions_at_half_the_head() -> None:
    order = head_order(16, 8)
    assert sorted(order.tolist()) == list(range(16))
    # New pairs (i, i + 8): rotated pairs (i, i + 4) for i < 4, passed dimensions after.
    assert [(order[i].item(), order[i + 8].item()) for i in range(8)] == [
        (0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]


# ---------------------------------------------------------------------------------------------
# The model against transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("text", "max_positions"), [(LONG_PROMPT, ORIGINAL),
                                                     (LONGER_PROMPT, 512)])
def test_logits_match_transformers(model_dir: Path, hf_model: Any, native: bool, text: str,
                                   max_positions: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within LongRoPE's original length with a limit there (the short factors), and beyond
    it with a longer limit (the long factors: transformers' whole sequence is longer)."""
    if native and not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    model = build_native(model_dir, native, monkeypatch, max_positions=max_positions)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    assert 2 * 7 < len(ids) and (len(ids) <= ORIGINAL) == (max_positions <= ORIGINAL)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 5
    for chunks in ([len(ids)], [5, 9, len(ids) - 14], [7] + [1] * (len(ids) - 7)):
        got = chunked_logits(model, ids, chunks)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=str(chunks))


def test_gguf_blocks_split_and_reorder_like_tensors(variant: str, model_dir: Path) -> None:
    """A GGUF file's fused qkv / gate_up (``GGUFWeight`` rows of Q8_0 blocks) are split and
    reordered by rows as tensors are, and the native block kernels then compute the logits
    of the same weights dequantized."""
    if not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    cfg = ModelConfig.from_dir(model_dir)
    blocks: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for name, w in loader.read_weights(model_dir, torch.float32, torch.device("cpu")).items():
        if w.dim() == 2:
            rows = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
            blocks[name] = GGUFWeight(name, 8, (w.shape[0], w.shape[1]), rows)
            plain[name] = blocks[name].dequantize()
        else:
            blocks[name] = plain[name] = w
    qkv_name = "model.layers.0.self_attn.qkv_proj.weight"
    qkv, values = blocks[qkv_name], plain[qkv_name]
    for piece, ref in zip(split_rows(qkv, [64, 32, 32]), values.split([64, 32, 32])):
        assert torch.equal(piece.dequantize(), ref)
    order = torch.randperm(values.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(reorder_rows(qkv, order).dequantize(), values[order])
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPTS[2], add_special_tokens=False)
    model = Phi3ForCausalLM(cfg, blocks, 512)
    assert model.uses_gguf_blocks
    chunks = [7] + [1] * (len(ids) - 7)
    torch.testing.assert_close(chunked_logits(model, ids, chunks),
                               chunked_logits(Phi3ForCausalLM(cfg, plain, 512), ids, chunks),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_batched_greedy_matches_transformers(variant: str, model_dir: Path, hf_model: Any,
                                             path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short prompts with the context limited to LongRoPE's original length, then prompts
    longer than it with the default limit; each batch in one ``generate``."""
    native, device = engine_path(path, monkeypatch)
    for texts, max_model_len, num_tokens in ((PROMPTS, ORIGINAL, 16),
                                             ([LONGER_PROMPT, LONGER_PROMPT[40:]], None, 32)):
        llm = LLM(str(model_dir), kv_cache_tokens=4096, dtype="float32", progress=False,
                  device=device, max_model_len=max_model_len)
        model = llm.engine.core.runner.model
        assert isinstance(model, Phi3ForCausalLM) and model.native is native
        window = 7 if variant == "window" else None
        assert model.windows == [window] * model.config.num_layers
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in texts]
        if max_model_len is None:
            assert min(len(p) for p in prompts) > ORIGINAL
        else:
            assert max(len(p) for p in prompts) + num_tokens <= ORIGINAL
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens,
                                                    ignore_eos=True))
        expected = hf_greedy(hf_model, prompts, num_tokens)
        assert [o.outputs[0].token_ids for o in outs] == expected, max_model_len
        assert all(len(set(ref)) > 8 for ref in expected)


def test_sliding_window_config_matches_transformers_and_json(model_dir: Path) -> None:
    data = json.loads((model_dir / "config.json").read_text())
    assert (data.get("sliding_window") is not None) == bool(
        ModelConfig.from_dir(model_dir).layer_windows)
