"""Native Phi-3 causal LM (transformers' ``Phi3ForCausalLM``: Phi-3, Phi-3.5, Phi-4-mini).

Llama's model (llama.py) exactly: Phi-3 differs only in how its checkpoint and config say
it, each taken here as transformers computes it:

- the fused ``qkv_proj`` and ``gate_up_proj`` weights are split by rows into Llama's
  q/k/v and gate/up weights (which the Llama block fuses again, in the same order);
- ``partial_rotary_factor`` < 1 rotates the first ``rotary_dim`` dimensions of each head
  (NEOX pairs ``i, i + rotary_dim / 2``) and passes the rest through. Each q and k head's
  rows are reordered so that those pairs are the full-width pairs ``i, i + head_dim / 2``
  that Llama's rotation (and the native kernels) use, with the passed dimensions rotated
  by angle 0 (cos 1, sin 0: the same floats); q·k does not depend on the order;
- LongRoPE (``rope_scaling`` type ``longrope``): cos and sin times the attention factor,
  the frequencies of one factor set for every position of every sequence: the long factors
  where the context limit (``max_positions``, the engine's ``max_model_len``) exceeds
  ``original_max_position_embeddings``, else the short ones (llama.cpp's rule). transformers
  uses the short factors while a sequence is within the original length and the long ones
  for all its positions once it is longer (``generate`` recomputes the cache when it
  crosses), so the two agree for every sequence with a limit within the original length,
  and for prompts longer than it with a longer limit. Switching per position instead would
  rotate a query and a key of one sequence with different frequencies;
- ``sliding_window`` applies to every layer, as in transformers (llama.cpp ignores it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


def split_rows(weight: Any, sizes: list[int]) -> list[Any]:
    """``weight`` (a float tensor or a GGUF weight, rows = output features) as consecutive
    pieces of ``sizes`` rows."""
    if isinstance(weight, torch.Tensor):
        return list(weight.split(sizes))
    pieces, start = [], 0
    for size in sizes:
        pieces.append(weight.take_rows(start, start + size))
        start += size
    return pieces


def reorder_rows(weight: Any, order: torch.Tensor) -> Any:
    """``weight`` with row ``i`` taken from row ``order[i]``."""
    if isinstance(weight, torch.Tensor):
        return weight[order]
    return weight.reorder(order.numpy())


def rotary_dim(cfg: ModelConfig) -> int:
    """The dimensions of a head that RoPE rotates; raises for a fraction that leaves an odd
    number of either kind."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    if dim <= 0 or dim % 2 or (cfg.head_dim - dim) % 2:
        raise ModelLoadError(
            f"{cfg.architecture} partial_rotary_factor {cfg.partial_rotary_factor} rotates {dim} "
            f"of {cfg.head_dim} dimensions per head; FreeToken needs an even number of both "
            "rotated and passed dimensions")
    return dim


def head_order(head_dim: int, rot: int) -> torch.Tensor:
    """Within a head, the original dimension each new one takes: the first half of the
    rotated ones, the first half of the passed ones, then the second halves."""
    half, passed = rot // 2, (head_dim - rot) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rot, rot + passed),
                      torch.arange(half, rot), torch.arange(rot + passed, head_dim)])


def unfuse_layer(weights: Weights, prefix: str, cfg: ModelConfig, rot: int) -> None:
    """Layer ``prefix``'s Phi-3 weights renamed and split into Llama's, in place."""
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv = weights.pop(attn + "qkv_proj.weight", None)
    if qkv is not None:
        for name, part in zip("qkv", split_rows(qkv, [h * d, kvh * d, kvh * d])):
            weights[f"{attn}{name}_proj.weight"] = part
    gate_up = weights.pop(mlp + "gate_up_proj.weight", None)
    if gate_up is not None:
        size = cfg.intermediate_size
        weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"] = split_rows(
            gate_up, [size, size])
    if rot < d:
        order = head_order(d, rot)
        for name, heads in (("q", h), ("k", kvh)):
            rows = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
            key = f"{attn}{name}_proj.weight"
            weights[key] = reorder_rows(weights[key], rows)


class RopeTables:
    """cos/sin rows by position, ``[max_positions, head_dim]``, for Llama's rotation."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def phi3_rope(cfg: ModelConfig, max_positions: int, rot: int, dtype: torch.dtype,
              device: torch.device) -> RopeTables:
    """Phi-3's rotation tables for positions below ``max_positions`` (default or LongRoPE,
    partial or not; module docstring), each value as transformers' ``Phi3RotaryEmbedding``
    computes it."""
    exponent = torch.arange(0, rot, 2, dtype=torch.int64).float() / rot
    base = cfg.rope_theta ** exponent
    t = torch.arange(max_positions, dtype=torch.float32)
    scaling = cfg.rope_scaling
    attention_factor = 1.0
    if scaling is None:
        freqs = torch.outer(t, 1.0 / base)
    else:  # longrope (config_fields.py refuses other types)
        original = scaling["original_max_position_embeddings"]
        key = "long_factor" if max_positions > original else "short_factor"
        values = scaling.get(key)
        if values is None or len(values) != rot // 2:
            raise ModelLoadError(f"Phi3ForCausalLM longrope needs {key} of {rot // 2} "
                                 f"numbers, not {values!r}")
        factors = torch.tensor(values, dtype=torch.float32)
        freqs = torch.outer(t, 1.0 / (factors * base))
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            factor = scaling.get("factor") or cfg.max_position_embeddings / original
            attention_factor = (1.0 if factor <= 1.0 else
                                math.sqrt(1 + math.log(factor) / math.log(original)))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    if rot < cfg.head_dim:  # the passed dimensions at angle 0, where head_order put them
        ones = torch.ones(max_positions, (cfg.head_dim - rot) // 2)
        half = rot // 2
        cos = torch.cat([cos[:, :half], ones, cos[:, half:], ones], dim=-1)
        sin = torch.cat([sin[:, :half], 0 * ones, sin[:, half:], 0 * ones], dim=-1)
    return RopeTables(cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 as Llama (module docstring); ``forward`` and ``compute_logits`` as
    ``LlamaForCausalLM``'s."""

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        rot = rotary_dim(cfg)
        for i in range(cfg.num_layers):
            unfuse_layer(weights, f"model.layers.{i}.", cfg, rot)
        # Llama's rotation tables know no longrope: built without it, then replaced.
        super().__init__(dataclasses.replace(cfg, rope_scaling=None), weights, max_positions,
                         shard)
        self.config = cfg
        self.rotary = phi3_rope(cfg, max_positions, rot, self.embedding.dtype,
                                self.embedding.device)

