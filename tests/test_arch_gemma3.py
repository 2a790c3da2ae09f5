"""Gemma 3 (text) against transformers' ``Gemma3ForCausalLM``, and sliding-window attention.

A tiny random Gemma 3 with global and sliding-window layers (window 6, shorter than every
prompt but one), head_dim unlike hidden / heads, a query scale unlike head_dim's, linear
rope scaling on the global layers and tied embeddings. FreeToken's logits of a prompt, fed
in chunks over the paged cache (so prefill, chunked prefill and decode steps all attend
across the window), match transformers' float32 logits to 1e-4 on both attention paths,
and greedy tokens of a batch of prompts equal transformers' ``generate``."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, GenerationConfig
from transformers import Gemma3ForCausalLM as HFGemma3

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models import llama, loader
from freetoken_core.models.attention import AttentionMetadata, SequenceSpans, paged_attention
from freetoken_core.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from freetoken_core.models.gemma2 import Gemma2ForCausalLM
from freetoken_core.models.gemma3 import Gemma3ForCausalLM
from freetoken_core.models.glm4 import Glm4ForCausalLM
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.phi3 import Phi3ForCausalLM
from freetoken_core.models.registry import SUPPORTED, model_class
from freetoken_core.models.sharding import Shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):",
    "Once upon a time there was a little robot who wanted to learn how to write stories",
    "x",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
]
LONG_PROMPT = "Sampling turns the logits into probabilities: temperature rescales them, and top-k"


def make_gemma3(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Gemma 3 directory (weights, config, tokenizer) with well-separated greedy
    logits: embeddings small beside the residual branches (post-norm multipliers ~3), so
    the tied head does not just echo the last token."""
    tok = build_tokenizer(out_dir)
    kwargs: dict[str, Any] = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
        "layer_types": LAYER_TYPES, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2, **overrides,
    }
    config = Gemma3TextConfig(**kwargs)
    config.architectures = ["Gemma3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HFGemma3(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    norm_centres = {"q_norm": 1.0, "k_norm": 1.0, "post_attention_layernorm": 2.0,
                    "post_feedforward_layernorm": 2.0, "model.norm": 3.0}
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = name.rsplit(".", 2)[-2] if name != "model.norm.weight" else "model.norm"
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.125, generator=gen)
                param[:7] *= 0.5  # special tokens: rarely greedy picks
            elif "norm" in name:
                centre = norm_centres.get(kind, 0.0)
                param.uniform_(centre - 0.1, centre + 0.1, generator=gen)
            else:
                param.normal_(0.0, 2.0 / math.sqrt(param.shape[1]), generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out_dir)
    return out_dir




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# The engine's paths: native CPU kernels, torch on the CPU, torch on CUDA (float32, TF32 off,
# as tests/test_model_exactness.py runs it).
PATHS = ["native", "torch", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


def engine_path(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, str]:
    """``(native, device)`` of one of ``PATHS``, the kernels switched off for "torch"."""
    if path == "native" and not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    if path == "torch":
        monkeypatch.setattr(llama, "cpu_kernels_available", lambda: False)
    return path == "native", "cuda" if path == "cuda" else "cpu"


def build_native(model_dir: Path, native: bool, monkeypatch: pytest.MonkeyPatch,
                 cfg: ModelConfig | None = None, max_positions: int = 512) -> Any:
    """FreeToken's model of ``model_dir`` (``native``: the native kernels, else torch)."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(llama, "cpu_kernels_available", lambda: False)
        weights = loader.read_weights(model_dir, torch.float32, torch.device("cpu"))
        model = model_class(cfg)(cfg, weights, max_positions)
    assert model.native is native
    return model


def chunked_logits(model: Any, ids: list[int], chunks: list[int], block_size: int = 4
                   ) -> torch.Tensor:
    """Logits of every position of ``ids``, computed ``chunks`` tokens a step over one
    sequence's paged cache (its blocks in reverse order)."""
    cfg = model.config
    num_blocks = -(-len(ids) // block_size)
    table = list(range(num_blocks))[::-1]
    layers, heads, dim = kv_cache_dims(cfg)
    cache = torch.zeros(layers, num_blocks * block_size, 2, heads, dim)
    out, start = [], 0
    recurrent = getattr(model, "recurrent", False)
    if recurrent:  # (its states: one slot, the sequence's; the engine's back afterwards)
        engine_states = model.states
        model.allocate_states(1)
    with torch.inference_mode():
        for size in chunks:
            end = start + size
            meta = AttentionMetadata.build([table], [end], [size], block_size,
                                           torch.device("cpu"), native=model.native)
            if recurrent:
                meta.sequences = SequenceSpans.build([end], [size], [0], torch.device("cpu"))
            hidden = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end),
                                   cache, meta)
            out.append(model.compute_logits(hidden))
            start = end
    assert start == len(ids)
    if recurrent:
        model.states = engine_states
    return torch.cat(out)


def assert_chunks_match(model: Any, hf: Any, ids: list[int], second: list[int]) -> None:
    """``model``'s logits of ``ids`` equal ``hf``'s, the prompt fed whole and in the chunk
    lengths ``second``."""
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    for chunks in ([len(ids)], second):
        torch.testing.assert_close(chunked_logits(model, ids, chunks), want, atol=1e-3,
                                   rtol=1e-4)


def hf_greedy(hf: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                              do_sample=False, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_reads_gemma3(model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "gemma3"
    assert model_class(cfg) is Gemma3ForCausalLM
    assert cfg.head_dim == 32 and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear"
    assert cfg.rope_scaling["factor"] == 2.0
    assert cfg.query_scale == 24 ** -0.5
    assert cfg.final_logit_softcap is None
    assert cfg.sliding_window is None  # the engine caps the context only for Mistral's


def test_config_reads_hub_style_keys(model_dir: Path) -> None:
    """Hub checkpoints (transformers 4.5x) say rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of rope_parameters and layer_types."""
    data = json.loads((model_dir / "config.json").read_text())
    new_style = ModelConfig.from_dict(data)
    for key in ("rope_parameters", "layer_types"):
        data.pop(key)
    data.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2,
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(data) == new_style
    # transformers' defaults: every sixth layer global, bases 1e6 and 1e4, no scaling.
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        data.pop(key)
    data["num_hidden_layers"] = 12
    cfg = ModelConfig.from_dict(data)
    assert cfg.layer_windows == ((WINDOW,) * 5 + (None,)) * 2
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)


@pytest.mark.parametrize(("change", "message"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden activation 'gelu' is not supported"),
    ({"sliding_window": None}, "needs sliding_window >= 1"),
    ({"layer_types": ["full_attention"]}, "expected 4 of"),
])
def test_config_refuses_what_is_not_implemented(model_dir: Path, change: dict,
                                                message: str) -> None:
    data = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({**data, **change})


def test_registry_maps_every_architecture() -> None:
    def config(name: str) -> ModelConfig:
        return ModelConfig.from_dict({
            "architectures": [name], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "sliding_window": 4, "mamba_n_heads": 2,  # (Granite 4's Mamba-2 heads of 8)
            "num_kv_shared_layers": 0,  # (Gemma 3n's 15 by default: more than its layer)
            "num_experts_per_tok": 1,  # (DeepSeek-V2's has no default, nor dots1's counts)
            **({"n_routed_experts": 2, "n_shared_experts": 1} if name == "Dots1ForCausalLM"
               else {})})

    classes = {family: model_class(config(name))
               for name, family in SUPPORTED_ARCHITECTURES.items()}
    assert classes["gemma3"] is Gemma3ForCausalLM and classes["phi3"] is Phi3ForCausalLM
    assert classes["glm4"] is Glm4ForCausalLM
    assert classes["gemma2"] is Gemma2ForCausalLM
    assert {family: classes[family].__name__ for family in (
        "gemma4", "gemma3n", "qwen3_5", "qwen3_next", "lfm2_moe", "granitemoehybrid",
        "nemotron_h", "falcon_h1")} == {
        "gemma4": "Gemma4ForCausalLM", "gemma3n": "Gemma3nForCausalLM",
        "qwen3_5": "Qwen3_5ForCausalLM",
        "qwen3_next": "Qwen3_5ForCausalLM", "lfm2_moe": "Lfm2ForCausalLM",
        "granitemoehybrid": "GraniteHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
        "falcon_h1": "FalconH1ForCausalLM"}
    assert {classes[f].__name__ for f in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")} == {
        "DeepseekForCausalLM"} and {classes[f].__name__ for f in (
        "minimax_m2", "dots1")} == {"Glm4MoeForCausalLM"}
    assert all(classes[f] is llama.LlamaForCausalLM for f in (
        "llama", "mistral", "qwen2", "qwen3", "granite", "qwen3_moe", "mixtral", "gpt_oss"))
    assert set(SUPPORTED) == set(classes)
    # The families with recurrent layers refuse tensor parallelism, naming themselves.
    recurrent = {f for f, cls in classes.items() if getattr(cls, "recurrent", False)}
    assert recurrent == {"qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe",
                         "granitemoehybrid", "nemotron_h", "falcon_h1"}
    for name, family in SUPPORTED_ARCHITECTURES.items():
        if family in recurrent:
            with pytest.raises(ModelLoadError, match=re.escape(
                    f"tensor parallelism of {classes[family].family} is not supported")):
                classes[family](config(name), {}, 8, shard=Shard(0, 2, None))
    unknown = dataclasses.replace(config("LlamaForCausalLM"), architecture="gpt2")
    with pytest.raises(ModelLoadError,
                       match=re.escape(f"'gpt2'; FreeToken runs {', '.join(sorted(SUPPORTED))}")):
        model_class(unknown)


# ---------------------------------------------------------------------------------------------
# The model against transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
def test_logits_match_transformers(model_dir: Path, hf_model: Any, native: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    model = build_native(model_dir, native, monkeypatch)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(LONG_PROMPT, add_special_tokens=False)
    assert len(ids) > 3 * WINDOW
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 5  # logits that a wrong norm, rope or scale would move a lot
    for chunks in ([len(ids)], [5, 9, len(ids) - 14], [7] + [1] * (len(ids) - 7)):
        got = chunked_logits(model, ids, chunks)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=str(chunks))


def test_final_logit_softcap_matches_transformers(model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              final_logit_softcapping=3.0).eval()
    cfg = dataclasses.replace(ModelConfig.from_dir(model_dir), final_logit_softcap=3.0)
    model = build_native(model_dir, cpu_kernels_available(), monkeypatch, cfg)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPTS[2], add_special_tokens=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = chunked_logits(model, ids, [len(ids)])
    assert got.abs().max() <= 3.0
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_batched_greedy_matches_transformers(model_dir: Path, hf_model: Any, path: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    native, device = engine_path(path, monkeypatch)
    llm = LLM(str(model_dir), kv_cache_tokens=4096, dtype="float32", progress=False,
              device=device)
    assert isinstance(llm.engine.core.runner.model, Gemma3ForCausalLM)
    assert llm.engine.core.runner.model.native is native
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert max(len(p) for p in prompts) > WINDOW
    # All prompts in one batch: prefills side by side, then decode steps of five sequences.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                ignore_eos=True))
    expected = hf_greedy(hf_model, prompts, 32)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(len(set(ref)) > 8 for ref in expected)  # not a degenerate model


# ---------------------------------------------------------------------------------------------
# Sliding-window attention (attention.py, the native kernel's window argument)
# ---------------------------------------------------------------------------------------------


def reference_attention(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                        lens: list[int], query_lens: list[int], block_size: int,
                        first_key: Callable[[int], int], scale: float) -> torch.Tensor:
    """Each query token against its keys, one at a time, as the definition says: those from
    ``first_key(its position)`` to its own."""
    rows, t = [], 0
    heads, kv_heads = q.shape[1], cache.shape[2]
    for table, length, num in zip(tables, lens, query_lens):
        for pos in range(length - num, length):
            slots = [table[k // block_size] * block_size + k % block_size
                     for k in range(first_key(pos), pos + 1)]
            keys = cache[slots, 0].repeat_interleave(heads // kv_heads, 1)
            values = cache[slots, 1].repeat_interleave(heads // kv_heads, 1)
            probs = (torch.einsum("hd,lhd->hl", q[t], keys) * scale).softmax(-1)
            rows.append(torch.einsum("hl,lhd->hd", probs, values).reshape(-1))
            t += 1
    return torch.stack(rows)


def paged_case(block_size: int, seed: int) -> tuple[Any, ...]:
    """Six sequences (decodes and prompt chunks) over shuffled blocks: ``(tables, lens,
    query_lens, cache, q, kv, written)``, ``written`` the cache holding ``kv``."""
    rng = random.Random(block_size)
    lens, query_lens = [1, 7, 30, 130, 45, 200], [1, 1, 1, 1, 13, 70]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks * block_size, 2, 3, 32, generator=gen)
    q = torch.randn(sum(query_lens), 6, 32, generator=gen)
    kv = torch.randn(sum(query_lens), 2, 3, 32, generator=gen)
    written = cache.clone()
    written.index_copy_(0, AttentionMetadata.build(tables, lens, query_lens, block_size,
                                                   torch.device("cpu")).slot_mapping, kv)
    return tables, lens, query_lens, cache, q, kv, written


@pytest.mark.parametrize("window", [1, 3, 6, 17, 64, None])
@pytest.mark.parametrize("block_size", [4, 16])
def test_windowed_attention_matches_the_definition(window: int | None,
                                                   block_size: int) -> None:
    tables, lens, query_lens, cache, q, kv, written = paged_case(block_size, window or 0)
    ref = reference_attention(q, written, tables, lens, query_lens, block_size,
                              lambda pos: 0 if window is None else max(0, pos + 1 - window),
                              0.3)
    paths = [True, False] if cpu_kernels_available() else [False]
    for native in paths:
        meta = AttentionMetadata.build(tables, lens, query_lens, block_size,
                                       torch.device("cpu"), native=native)
        out = paged_attention(q, kv, cache.clone(), meta.with_window(window), 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"native={native}")


def test_windowed_native_attention_of_a_token_does_not_depend_on_its_step() -> None:
    """Batch invariance holds with a window: a prompt's tokens get bit-identical attention
    as one chunk, in chunks of 7 beside two decoding sequences, or one a step."""
    if not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    gen = torch.Generator().manual_seed(3)
    block_size, length, window = 16, 50, 9
    tables = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11]]
    cache = torch.randn(12 * block_size, 2, 3, 64, generator=gen)
    q, kv = torch.randn(length, 9, 64, generator=gen), torch.randn(length, 2, 3, 64, generator=gen)
    others_q = torch.randn(2, 9, 64, generator=gen)
    others_kv = torch.randn(2, 2, 3, 64, generator=gen)

    def attend(start: int, end: int, with_others: bool) -> torch.Tensor:
        lead_tables, lead_lens = (tables[1:], [33, 70]) if with_others else ([], [])
        meta = AttentionMetadata.build(lead_tables + tables[:1], lead_lens + [end],
                                       [1] * len(lead_lens) + [end - start], block_size,
                                       torch.device("cpu"), native=True)
        lead = len(lead_lens)
        step_q = torch.cat([others_q[:lead], q[start:end]])
        step_kv = torch.cat([others_kv[:lead], kv[start:end]])
        return paged_attention(step_q, step_kv, cache, meta.with_window(window))[lead:]

    whole = attend(0, length, False)
    for size, with_others in ((7, True), (1, False), (16, True)):
        parts = [attend(i, min(i + size, length), with_others)
                 for i in range(0, length, size)]
        assert torch.equal(torch.cat(parts), whole), size
