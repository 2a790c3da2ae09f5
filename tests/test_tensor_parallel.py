"""Tensor parallelism (``tensor_parallel_size=2``, gloo + shared memory on this machine):
the split itself, and greedy tokens equal to one rank's on the exactness prompts, for the
default model and random Qwen3- and Gemma3-shaped models as HF directories and GGUF files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import psutil
import pytest
from gguf_models import write_gguf
from test_model_exactness import PROMPTS
from tiny_models import make_tiny_model

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_weights import GGUFWeight
from freetoken_core.models.sharding import HeadSplit, even_ranges, head_splits, take_columns

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_even_ranges_give_the_first_ranks_the_remainder() -> None:
    assert even_ranges(9, 2) == [(0, 5), (5, 9)]
    assert even_ranges(49152, 2) == [(0, 24576), (24576, 49152)]


def test_kv_heads_split_unevenly_with_their_query_heads() -> None:
    # SmolLM2: 9 query heads on 3 KV heads; 2 ranks hold 2 + 1 KV heads.
    assert head_splits(9, 3, 2) == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 9, 2, 3)]


def test_more_ranks_than_kv_heads_share_a_kv_head() -> None:
    assert head_splits(8, 2, 4) == [HeadSplit(0, 2, 0, 1), HeadSplit(2, 4, 0, 1),
                                    HeadSplit(4, 6, 1, 2), HeadSplit(6, 8, 1, 2)]
    with pytest.raises(ModelLoadError, match="cannot split 9 attention heads"):
        head_splits(9, 3, 4)


def test_columns_are_cut_on_block_boundaries() -> None:
    rows = np.arange(4 * 2 * 144, dtype=np.uint8).reshape(4, 2 * 144)  # Q4_K: 256 a block
    weight = GGUFWeight("blk.0.ffn_down.weight", 12, (4, 512), rows)
    right = take_columns(weight, 256, 512)
    assert right.shape == (4, 256) and (right.rows == rows[:, 144:]).all()
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight .*blocks hold 256"):
        take_columns(dataclasses.replace(weight), 128, 512)


def _greedy(model: str, prompts: list[list[int]], tp: int, **options) -> list[list[int]]:
    with LLM(model, tensor_parallel_size=tp, kv_cache_tokens=4096, progress=False,
             **options) as llm:
        outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _check_tp_equals_one_rank(model: str, **options) -> None:
    with LLM(model, kv_cache_tokens=4096, progress=False, **options) as llm:
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert _greedy(model, prompts, 2, **options) == one
    assert not _children(), "a rank outlived its engine"


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "tensor_parallel" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_default_model_tp2_equals_tp1() -> None:
    _check_tp_equals_one_rank(None)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "smollm2"])
def test_hf_dir_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    _check_tp_equals_one_rank(str(make_tiny_model(tmp_path / arch, arch)), dtype="float32")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "llama"])
def test_gguf_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, ff=256)
    _check_tp_equals_one_rank(str(path))
