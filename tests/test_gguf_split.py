"""Split GGUF files (llama.cpp's ``gguf-split`` shards, as Qwen's own GGUF repositories ship
them) are served from the first shard's path, as llama.cpp serves them, with the same
tokens as the unsplit file; a wrong shard or a missing one is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_models import Q4_0, Q8_0, write_gguf

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", "x"]
MODEL = {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 2, "weight_type": Q8_0,
         "types": {"ffn_down.weight": Q4_0}, "seed": 7}


def greedy(path: Path) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_tokens=512, dtype="float32", progress=False,
              plugins="none")
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_split_file_serves_as_the_whole(tmp_path: Path) -> None:
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_gguf(tmp_path / "whole" / "tiny.gguf", "llama", **MODEL)
    first = write_gguf(tmp_path / "split" / "tiny.gguf", "llama", split_max_tensors=7,
                       **MODEL)
    shards = sorted(first.parent.iterdir())
    assert first == shards[0] and first.name == f"tiny-00001-of-{len(shards):05d}.gguf"
    assert len(shards) >= 3
    assert greedy(first) == greedy(whole)


def test_wrong_or_missing_shard_is_named(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "tiny.gguf", "llama", split_max_tensors=7, **MODEL)
    count = len(list(tmp_path.iterdir()))
    second = first.with_name(f"tiny-00002-of-{count:05d}.gguf")
    with pytest.raises(ModelLoadError, match=f"shard 2 of a {count}-shard split GGUF; pass "
                                             f"the first shard, tiny-00001-of-{count:05d}"):
        LLM(str(second), kv_cache_tokens=512, progress=False, plugins="none")
    last = first.with_name(f"tiny-{count:05d}-of-{count:05d}.gguf")
    last.rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(ModelLoadError, match=f"shard {last.name} is missing"):
        LLM(str(first), kv_cache_tokens=512, progress=False, plugins="none")
    renamed = tmp_path / "renamed.gguf"
    first.rename(renamed)
    with pytest.raises(ModelLoadError, match="not named like one"):
        LLM(str(renamed), kv_cache_tokens=512, progress=False, plugins="none")


def test_file_bytes_counts_every_shard(tmp_path: Path) -> None:
    """The memory check before the KV cache is written counts every shard's bytes."""
    from freetoken_core.models.gguf_reader import file_bytes

    first = write_gguf(tmp_path / "m.gguf", "llama", weight_type=Q8_0, split_max_tensors=8)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) > 1 and first == shards[0]
    assert file_bytes(first) == sum(p.stat().st_size for p in shards)
    whole = write_gguf(tmp_path / "whole.gguf", "llama", weight_type=Q8_0)
    assert file_bytes(whole) == whole.stat().st_size
