"""Every architecture FreeToken reads from GGUF metadata, exact against transformers.

For llama (incl. Mistral files, which use it), qwen2, qwen3, gemma2, gemma3 and phi3: a small
random-weight GGUF written the way llama.cpp's converter names tensors and keys
(tests/gguf_models.py), in a mix of block types as real files mix them; FreeToken's greedy
tokens, in one batch, equal transformers' own GGUF loader's (which dequantizes every block
type to float32 and undoes llama's q/k permutation and Gemma's norm offset independently of
FreeToken's reader). The rotary pairing is the trap this guards: llama files store q/k
permuted for adjacent pairs, the others use half-offset pairs on unpermuted weights, and
getting it wrong gives fluent-looking garbage without an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import (
    BF16,
    F16,
    F32,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    write_gguf,
)
from gguf_reference import hf_from_gguf
from gguf_writing import finish

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.block_layout import (
    ACTIVATIONS_INT24,
    INT24_TYPES,
    KIND_PARTS,
    int_linear_available,
    parts_types,
)

PROMPTS = [
    "Hello world, this is",
    "def add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "x",
]

# arch -> write_gguf arguments: each a different mix of block types (K-quants need rows of
# 256 weights, so those models are 256 wide). Head sizes as the real families have them,
# where transformers' GGUF loader takes its default instead of the file's key (Qwen3's
# head_dim 128, Gemma's query_pre_attn_scalar 256 = head_dim; Gemma 2's softcaps, 50 and 30,
# its loader's defaults and the converter's values).
CASES = {
    "llama": {"hidden": 256, "ff": 512, "heads": 4, "kv_heads": 2, "weight_type": Q4_K,
              "types": {"attn_v.weight": Q6_K, "ffn_down.weight": Q6_K,
                        "token_embd.weight": Q6_K}},
    "qwen2": {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 2, "weight_type": Q5_0,
              "types": {"token_embd.weight": Q8_0, "attn_v.weight": Q8_0,
                        "ffn_up.weight": MXFP4, "ffn_down.weight": Q4_1}},
    "qwen3": {"hidden": 256, "ff": 512, "heads": 2, "kv_heads": 1, "head_dim": 128,
              "weight_type": IQ4_XS, "tied": False,
              "types": {"attn_output.weight": Q5_K, "ffn_gate.weight": Q3_K,
                        "ffn_up.weight": Q2_K, "token_embd.weight": Q6_K}},
    "gemma2": {"hidden": 64, "ff": 128, "heads": 2, "kv_heads": 1, "head_dim": 256,
               "layers": 4, "weight_type": Q5_0, "sliding_window": 6,
               "types": {"token_embd.weight": BF16, "attn_output.weight": Q4_K,
                         "ffn_up.weight": Q8_0}},
    "gemma3": {"hidden": 64, "ff": 128, "heads": 2, "kv_heads": 1, "head_dim": 256,
               "layers": 6, "rope_theta": 1e6, "weight_type": Q4_0, "sliding_window": 6,
               "types": {"token_embd.weight": F16, "ffn_down.weight": IQ4_NL}},
    "phi3": {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 4, "weight_type": Q5_1,
             "tied": False,
             "types": {"token_embd.weight": BF16, "attn_qkv.weight": Q8_0,
                       "output.weight": F32}},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, Path]:
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    return arch, write_gguf(path, arch, seed=len(arch), **CASES[arch])


# The low-bit i-quants (IQ3_M ... IQ1_S files), every one of them in a llama 256 wide: the
# fused q/k/v and gate/up are linears of parts of three and two of them, the embedding is
# read from IQ3_S blocks, and the untied Q6_K head is a type the int24 kernel has beside them.
IQ_CASE = {"hidden": 256, "ff": 512, "heads": 4, "kv_heads": 2, "weight_type": IQ2_XXS,
           "tied": False,
           "types": {"attn_k.weight": IQ2_XS, "attn_v.weight": IQ3_S,
                     "attn_output.weight": IQ3_XXS, "ffn_gate.weight": IQ2_S,
                     "ffn_up.weight": IQ1_S, "ffn_down.weight": IQ1_M,
                     "token_embd.weight": IQ3_S, "output.weight": Q6_K}}


def test_greedy_matches_transformers_gguf_loader(gguf_model: tuple[str, Path]) -> None:
    assert_greedy_matches_transformers(*gguf_model)


def test_i_quant_llama_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny-iq.gguf", "llama", seed=16, **IQ_CASE)
    assert_greedy_matches_transformers("llama", path)


def assert_greedy_matches_transformers(arch: str, path: Path) -> None:
    """FreeToken's greedy tokens for PROMPTS, in one batch, equal transformers' GGUF
    loader's, with the linears on the kernels the default arithmetic picks."""
    # No plugins: the model is under test.
    llm = LLM(str(path), kv_cache_tokens=2048, dtype="float32", progress=False,
              plugins="none")
    model = llm.engine.core.runner.model
    assert model.config.architecture == arch
    assert model.uses_gguf_blocks  # computed from the file's blocks, not a float32 copy
    if cpu_kernels_available() and int_linear_available():
        # The default arithmetic there: every linear of the int24 kernel's types (each
        # part's, for a linear of parts) is on it, the others (F16, BF16, ...) are not.
        for lin in [lin for layer in model.layers for lin in layer.linears] + [model.lm_head]:
            qtype, blocks = lin.blocks
            kernel_type = qtype & ~ACTIVATIONS_INT24
            types = parts_types(blocks) if kernel_type == KIND_PARTS else [kernel_type]
            expected = all(t in INT24_TYPES for t in types) and lin.out_features % 16 == 0
            assert bool(qtype & ACTIVATIONS_INT24) == expected, (arch, types)
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                ignore_eos=True))
    hf = hf_from_gguf(path)
    distinct = set()
    for ids, out in zip(prompts, outs):
        # (an explicit mask: transformers would take prompt tokens equal to the pad id for
        # padding)
        prompt = torch.tensor([ids])
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False, pad_token_id=0)
        ref = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, (arch, ids)
        distinct |= set(ref)
    # Not a degenerate model that repeats one token. (The tiny random Gemma 3 falls into a
    # loop within a few tokens: 8 distinct over the four prompts as the GGUF's own BPE
    # tokenizes them, issue #34; more than 8 under transformers' SentencePiece-style
    # conversion of this BPE vocabulary, whose prompt ids were not the file's.)
    assert len(distinct) > 4


def test_amx_tiles_that_disagree_with_vnni_are_turned_off(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_amx_tiles`` (at load, where the int24 kernel has AMX tiles): the smallest
    linear of each type and of each mix of parts computes 16 random rows on the tiles (mode
    0) and on VNNI (mode 2); equal floats keep the tiles, a difference turns them off for the
    process and names the linear. On this CPU without AMX the tiles are stood in for by the
    VNNI path, one type's outputs perturbed."""
    if not (cpu_kernels_available() and int_linear_available()):
        pytest.skip("no int24 kernel on this CPU")
    path = write_gguf(tmp_path / "q4k.gguf", "llama", seed=3, **CASES["llama"])
    llm = LLM(str(path), kv_cache_tokens=2048, progress=False, plugins="none",
              activations="int24")
    model = llm.engine.core.runner.model
    ops = torch.ops.freetoken
    real = ops.gguf_linear_int
    calls, allowed, perturbed = [], [], []

    def tiles_or_vnni(x, blocks, qtype, out, mode=0):
        real(x, blocks, qtype, out, 2 if mode == 0 else mode)
        calls.append((qtype, mode))
        if mode == 0 and qtype in perturbed:
            out.add_(1e-3)

    monkeypatch.setattr(ops, "gguf_int_amx_types", lambda: [12, 14])
    monkeypatch.setattr(ops, "gguf_linear_int", tiles_or_vnni)
    monkeypatch.setattr(ops, "gguf_int_amx_allow", allowed.append)
    assert model.check_amx_tiles() is None and allowed == []
    # Q4_K (o, gate/up), Q6_K (down, the head) and the q/k/v of Q4_K and Q6_K parts
    assert sorted(set(calls)) == [(12, 0), (12, 2), (14, 0), (14, 2), (1 << 10, 0),
                                  (1 << 10, 2)]
    perturbed.append(14)
    said = model.check_amx_tiles()
    assert allowed == [False]
    assert said is not None and "Q6_K linear's floats on the AMX tiles differ" in said


def test_q4_k_on_the_int24_kernel_is_exact_too(tmp_path: Path) -> None:
    """``--activations int24`` computes Q4_K (and the Q6_K of a Q4_K_M mix) in the integer
    kernel: greedy tokens still equal transformers'."""
    if not (cpu_kernels_available() and int_linear_available()):
        pytest.skip("no int24 kernel on this CPU")
    path = write_gguf(tmp_path / "q4k.gguf", "llama", seed=3, **CASES["llama"])
    llm = LLM(str(path), kv_cache_tokens=2048, progress=False, plugins="none",
              activations="int24")
    layer = llm.engine.core.runner.model.layers[0]
    assert layer.o_proj.blocks[0] == 12 | 1 << 9  # Q4_K on the int24 kernel
    assert layer.down_proj.blocks[0] == 14 | 1 << 9  # Q6_K
    assert layer.qkv_proj.blocks[0] == 1 << 10 | 1 << 9  # q, k Q4_K and v Q6_K: parts
    model = llm.engine.core.runner.model
    assert model.lm_head.blocks[0] == 14 | 1 << 9  # the tied Q6_K
    assert model.embedding.blocks is model.lm_head.blocks  # read by the embedding too: one copy
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))
    hf = hf_from_gguf(path)
    for ids, out in zip(prompts, outs):
        prompt = torch.tensor([ids])
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                          min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_unknown_architecture_names_it_and_the_supported(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "mamba")
    finish(writer)
    with pytest.raises(ModelLoadError, match="'mamba' is not supported.*gemma3.*phi3.*qwen3"):
        LLM(str(path), progress=False)
