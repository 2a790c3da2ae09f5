"""Tensor parallelism's split of a model across ranks (``--tensor-parallel-size N``).

Megatron's split, as vLLM and SGLang make it: each rank holds

- its attention heads: q/k/v rows (and their biases) of its query heads and of the KV
  heads they read (column-parallel), the o projection's columns of its query heads
  (row-parallel: each rank's output is a partial sum, all-reduced);
- its slice of the MLP's intermediate features: gate/up rows, down's columns (row-parallel,
  all-reduced);
- its slice of the vocabulary: embedding rows (a token outside the slice embeds as zeros,
  so the all-reduce of the ranks' rows is the token's row exactly) and head rows (rank 0
  gathers the ranks' logits);
- norms, rotary tables and every other small weight whole.

KV heads are split into contiguous runs (uneven where they do not divide: SmolLM2's 3 KV
heads on 2 ranks are 2 + 1, with 6 + 3 query heads), or, with more ranks than KV heads,
each KV head is kept by ``N / KV heads`` ranks that split its query heads. A split must
keep whole GGUF blocks: columns are cut on the weight type's block boundaries (32 or 256
weights); a shape that cannot be cut so is refused at load, naming the tensor.

The all-reduces sum the ranks' partial results in rank order on every rank
(``Communicator.all_reduce``), so every rank holds the same hidden states; the sums group
the terms differently from one rank's dot products, so TP=N's floats may differ from TP=1's
in the last bits (greedy tokens are compared in the tests).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_weights import GGUF_TYPES


@dataclass
class CommTimes:
    """Wall time this rank spent in the group's collectives (waiting for the slowest rank
    included), and how many: the cost of tensor parallelism (``/internal/stats``)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class Shard:
    """This process's part of a tensor-parallel group: ``comm`` has ``all_reduce`` and
    ``gather_to_first`` (``freetoken_core.distributed.comm.Communicator``)."""

    rank: int
    world_size: int
    comm: Any
    times: CommTimes = field(default_factory=CommTimes)


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads ``q0:q1``, KV heads ``kv0:kv1``."""

    q0: int
    q1: int
    kv0: int
    kv1: int


def even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``0:total`` cut into ``parts`` contiguous ranges, the first ``total % parts`` one
    longer than the rest."""
    size, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def head_splits(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadSplit]:
    """Each rank's heads (module docstring); raises ``ModelLoadError`` for a head count
    that cannot be split so."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        return [HeadSplit(kv0 * group, kv1 * group, kv0, kv1)
                for kv0, kv1 in even_ranges(num_kv_heads, world_size)]
    per_kv = world_size // num_kv_heads
    if world_size % num_kv_heads or group % per_kv:
        raise ModelLoadError(
            f"--tensor-parallel-size {world_size} cannot split {num_heads} attention heads "
            f"with {num_kv_heads} KV heads: with more ranks than KV heads, the ranks must be "
            "a multiple of the KV heads and each KV head's query heads a multiple of the "
            "ranks that share it")
    q_per_rank = group // per_kv
    return [HeadSplit(r * q_per_rank, (r + 1) * q_per_rank, r // per_kv, r // per_kv + 1)
            for r in range(world_size)]


def _unit(weight: Any) -> tuple[int, int]:
    """(weights, bytes) of the smallest column run of ``weight`` that can be cut out: a
    GGUF block (runs of 32 values for float types, the native kernels' unit), or one
    column of a float tensor."""
    if isinstance(weight, torch.Tensor):
        return 1, 0
    _, block, size = GGUF_TYPES[weight.qtype]
    return (32, 32 * size) if block == 1 else (block, size)


def take_rows(weight: Any, start: int, stop: int) -> Any:
    """Rows (output features) ``start:stop`` of a float tensor or a GGUF weight (a view of
    its blocks)."""
    if isinstance(weight, torch.Tensor):
        return weight[start:stop]
    return weight.take_rows(start, stop)


def take_columns(weight: Any, start: int, stop: int) -> Any:
    """Columns (input features) ``start:stop`` of a float tensor or a GGUF weight (a copy
    of those blocks of each row; the file's pages are then released). Raises
    ``ModelLoadError`` where a bound is not on a block boundary."""
    if isinstance(weight, torch.Tensor):
        return weight[:, start:stop].contiguous()
    width, nbytes = _unit(weight)
    if start % width or stop % width:
        raise ModelLoadError(
            f"tensor {weight.name} ({weight.type_name}, {weight.shape[1]} columns) cannot be "
            f"split for tensor parallelism at columns {start}:{stop}: its blocks hold "
            f"{width} weights each; choose a --tensor-parallel-size that divides it on block "
            "boundaries")
    rows = np.ascontiguousarray(weight.rows[:, start // width * nbytes:stop // width * nbytes])
    weight.release()
    return dataclasses.replace(weight, shape=(weight.shape[0], stop - start), mapped=rows,
                               order=None)


def _feature_ranges(weights: dict[str, Any], name: str, total: int, world_size: int
                    ) -> list[tuple[int, int]]:
    """Even ranges of ``total`` input features of ``name`` cut on its block boundaries."""
    width = _unit(weights[name])[0]
    if total % width or total // width < world_size:
        raise ModelLoadError(
            f"tensor {weights[name].name} ({total} columns in blocks of {width}) cannot be "
            f"split over {world_size} tensor-parallel ranks on block boundaries")
    return [(a * width, b * width) for a, b in even_ranges(total // width, world_size)]


def shard_weights(cfg: ModelConfig, weights: dict[str, Any], shard: Shard
                  ) -> tuple[ModelConfig, tuple[int, int]]:
    """Replace ``weights`` (by Hugging Face name, q/k/v and gate/up unfused) by this rank's
    parts, in place. Returns the config of this rank's blocks (its head and intermediate
    counts) and its vocabulary range."""
    world, rank, d = shard.world_size, shard.rank, cfg.head_dim
    heads = head_splits(cfg.num_heads, cfg.num_kv_heads, world)[rank]
    intermediate = None
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name, (a, b) in (("q", (heads.q0, heads.q1)), ("k", (heads.kv0, heads.kv1)),
                             ("v", (heads.kv0, heads.kv1))):
            for kind in ("weight", "bias"):
                key = f"{p}self_attn.{name}_proj.{kind}"
                if key in weights:
                    weights[key] = take_rows(weights[key], a * d, b * d)
        key = p + "self_attn.o_proj.weight"
        weights[key] = take_columns(weights[key], heads.q0 * d, heads.q1 * d)
        bias = p + "self_attn.o_proj.bias"
        if bias in weights and rank != 0:  # (added once to the ranks' all-reduced sum)
            weights[bias] = torch.zeros_like(weights[bias])
        down = p + "mlp.down_proj.weight"
        i0, i1 = _feature_ranges(weights, down, cfg.intermediate_size, world)[rank]
        intermediate = i1 - i0
        for name in ("gate", "up"):  # (no gate where the MLP is not gated: Arcee's)
            for kind in ("weight", "bias"):
                key = f"{p}mlp.{name}_proj.{kind}"
                if key in weights:
                    weights[key] = take_rows(weights[key], i0, i1)
        weights[down] = take_columns(weights[down], i0, i1)
        bias = p + "mlp.down_proj.bias"
        if bias in weights and rank != 0:  # (as the o projection's)
            weights[bias] = torch.zeros_like(weights[bias])
    v0, v1 = even_ranges(cfg.vocab_size, world)[rank]
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in weights:
            weights[key] = take_rows(weights[key], v0, v1)
    local = dataclasses.replace(cfg, num_heads=heads.q1 - heads.q0,
                                num_kv_heads=heads.kv1 - heads.kv0,
                                intermediate_size=intermediate or cfg.intermediate_size)
    return local, (v0, v1)


def gather_logits(shard: Shard, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The whole vocabulary's logits on rank 0 from each rank's ``[n, its slice]``; the
    other ranks get ``[n, 0]``."""
    ranges = even_ranges(vocab_size, shard.world_size)
    widest = max(b - a for a, b in ranges)
    padded = logits
    if logits.shape[1] < widest:
        padded = torch.zeros(logits.shape[0], widest, dtype=logits.dtype, device=logits.device)
        padded[:, :logits.shape[1]] = logits
    start = time.perf_counter()
    parts = shard.comm.gather_to_first(padded.contiguous())
    shard.times.seconds += time.perf_counter() - start
    shard.times.calls += 1
    if parts is None:
        return logits[:, :0]
    return torch.cat([part[:, :b - a] for part, (a, b) in zip(parts, ranges)], dim=1)


def all_reduce(shard: Shard, x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks, in place."""
    start = time.perf_counter()
    shard.comm.all_reduce(x)
    shard.times.seconds += time.perf_counter() - start
    shard.times.calls += 1
    return x
