"""Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's ``linear_attention``
layers (transformers' ``Qwen3_5GatedDeltaNet``, ``Qwen3NextGatedDeltaNet``: the same but for
how its projections are fused, ``unfuse_qwen3_next``), over per-sequence recurrent states.

A layer keeps, per sequence, instead of keys and values: its convolution's last ``kernel -
1`` inputs (``conv`` ``[slots, channels, kernel - 1]``) and a recurrent state per value head
(``ssm`` ``[slots, value heads, key size, value size]``, float32), in the slot the scheduler
gave the sequence (``Sequence.slot``; ``RecurrentStates``). A token's computation, as
transformers computes it:

- one projection gives ``[q | k | v]`` (the convolution's channels), ``z`` (the output
  gate), ``b`` and ``a`` (a number per value head each);
- ``[q | k | v]`` through a causal depthwise convolution over the sequence's last
  ``kernel`` inputs (zeros before its first token), then SiLU;
- q and k L2-normalized per head (float32, eps 1e-6), q times ``key size ** -0.5``, each
  key head serving ``value heads / key heads`` value heads;
- the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and the write strength
  ``beta = sigmoid(b)``; the state decays by ``exp(g)``, then takes the delta rule's update
  ``k (beta (v - S^T k))^T``, and the output is ``S^T q``;
- the output RMSNormed per value head (weight ``w``, not ``1 + w``), times ``silu(z)``, then
  the out projection.

A step's decoding sequences (one token each) update their states together; a prefill chunk
runs the chunked form (``chunked_delta_rule``, transformers' ``torch_chunk_gated_delta_rule``:
the same recurrence in blocks of 64 tokens) from its sequence's state, or from zeros where
its first token is the sequence's first (a new sequence, or one preempted and recomputed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import SequenceSpans
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.recurrent import conv_step, conv_with_state

CHUNK = 64


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension (the FLA library's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's tokens, in blocks of :data:`CHUNK`: ``q``,
    ``k`` ``[heads, T, key size]`` (normalized, q scaled), ``v`` ``[heads, T, value size]``,
    ``g`` and ``beta`` ``[heads, T]``, all float32, from ``state`` ``[heads, key size,
    value size]``; returns the outputs ``[heads, T, value size]`` and the final state."""
    heads, length, _ = k.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, CHUNK, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, chunks, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = g.cumsum(dim=-1)  # (log of the decay from the chunk's start to each token)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf"))
    pairwise = pairwise.exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * decay.exp()[..., None]
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False,
                                            unitriangular=True)
    out = torch.zeros_like(values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(chunks):
        fresh = values[:, i] - k_decay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ fresh
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of a batch of sequences: ``q``, ``k`` ``[B, heads, key size]``,
    ``v`` ``[B, heads, value size]``, ``g``, ``beta`` ``[B, heads]`` (float32), ``state``
    ``[B, heads, key size, value size]``; the outputs ``[B, heads, value size]`` and the
    new states."""
    state = state * g.exp()[..., None, None]
    memory = (state * k[..., None]).sum(dim=-2)
    delta = (v - memory) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


class RecurrentStates:
    """One linear-attention layer's states, a slot a running sequence: ``conv`` ``[slots,
    channels, kernel - 1]`` in the model's dtype and ``ssm`` ``[slots, value heads, key
    size, value size]`` in float32."""

    def __init__(self, slots: int, channels: int, kernel: int, heads: int, key_size: int,
                 value_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv = torch.zeros(slots, channels, kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(slots, heads, key_size, value_size, dtype=torch.float32,
                               device=device)


def unfuse_qwen3_next(weights: dict[str, Any], p: str, shape: tuple[int, ...]) -> None:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` (rows grouped by key head: its q, its
    k, then the v and z of the value heads it serves; its value heads' b, then their a), as
    Qwen3.5's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a`` (transformers'
    ``fix_query_key_value_ordering``), in ``weights`` under the layer's ``linear_attn.``
    prefix ``p``: rows reordered, float tensors or GGUF blocks alike. (A ``qwen3next`` GGUF
    file has ``in_proj_qkvz`` split into ``in_proj_qkv`` / ``_z`` already, ``in_proj_ba``
    not: ``gguf_qwen35``.)"""
    key_heads, value_heads, key_size, value_size, _ = shape
    group = value_heads // key_heads
    width = 2 * key_size + 2 * group * value_size  # (one key head's rows of qkvz)

    def rows(offset: int, size: int, stride: int) -> list[int]:
        return [h * stride + offset + i for h in range(key_heads) for i in range(size)]

    def split(name: str, orders: list[list[int]], parts: list[str]) -> None:
        w = weights.pop(p + name)
        order = [r for o in orders for r in o]
        if hasattr(w, "reorder"):  # (GGUF blocks: the rows reordered, then taken)
            w = w.reorder(np.array(order))
        else:
            w = w[torch.tensor(order)]
        start = 0
        for part, o in zip(parts, orders):
            weights[p + part] = (w.take_rows(start, start + len(o)) if hasattr(w, "take_rows")
                                 else w[start:start + len(o)])
            start += len(o)

    if p + "in_proj_qkvz.weight" in weights:  # (a qwen3next GGUF file's: split already)
        split("in_proj_qkvz.weight", [
            rows(0, key_size, width) + rows(key_size, key_size, width)
            + rows(2 * key_size, group * value_size, width),
            rows(2 * key_size + group * value_size, group * value_size, width)],
              ["in_proj_qkv.weight", "in_proj_z.weight"])
    split("in_proj_ba.weight", [rows(0, group, 2 * group), rows(group, group, 2 * group)],
          ["in_proj_b.weight", "in_proj_a.weight"])


class GatedDeltaNet:
    """Layer ``prefix``'s linear attention (module docstring), by transformers' names under
    ``linear_attn.``: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], prefix: str,
                 arena: BlockArena | None) -> None:
        p = prefix + "linear_attn."
        key_heads, value_heads, key_size, value_size, kernel = cfg.linear_attention_shape
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_size, self.value_size, self.kernel = key_size, value_size, kernel
        self.key_dim, self.value_dim = key_heads * key_size, value_heads * value_size
        self.channels = 2 * self.key_dim + self.value_dim
        if p + "in_proj_ba.weight" in weights:  # (Qwen3-Next's fused projections)
            unfuse_qwen3_next(weights, p, cfg.linear_attention_shape)
        self.in_proj = make_linear([weights.pop(p + f"in_proj_{n}.weight")
                                    for n in ("qkv", "z", "b", "a")], arena=arena)
        if self.in_proj.out_features != self.channels + self.value_dim + 2 * value_heads:
            raise ModelLoadError(f"{p}in_proj_*: {self.in_proj.out_features} outputs in all; "
                                 f"the config's linear-attention shape needs "
                                 f"{self.channels + self.value_dim + 2 * value_heads}")
        conv = weights.pop(p + "conv1d.weight")
        if tuple(conv.shape) not in ((self.channels, 1, kernel), (self.channels, kernel)):
            raise ModelLoadError(f"{p}conv1d.weight has shape {list(conv.shape)}; expected "
                                 f"[{self.channels}, 1, {kernel}]")
        self.conv_weight = conv.reshape(self.channels, 1, kernel)
        self.a_log = weights.pop(p + "A_log").float()
        self.dt_bias = weights.pop(p + "dt_bias")
        self.norm = weights.pop(p + "norm.weight")
        self.out_proj = make_linear([weights.pop(p + "out_proj.weight")], arena=arena)
        self.eps = cfg.rms_norm_eps
        self.tiled = cfg.linear_value_heads_tiled
        self.linears = (self.in_proj, self.out_proj)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's states (``RecurrentStates``) in this layer."""
        return (self.channels * (self.kernel - 1) * dtype.itemsize
                + self.value_heads * self.key_size * self.value_size * 4)

    def states(self, slots: int, dtype: torch.dtype, device: torch.device) -> RecurrentStates:
        return RecurrentStates(slots, self.channels, self.kernel, self.value_heads,
                               self.key_size, self.value_size, dtype, device)

    def __call__(self, x: torch.Tensor, states: RecurrentStates, spans: SequenceSpans
                 ) -> torch.Tensor:
        """The layer's output for the normed hidden states ``x`` ``[T, hidden]`` of the
        step's sequences (``spans``), their states read and written in place."""
        projected = self.in_proj(x)
        mixed, z, b, a = projected.split([self.channels, self.value_dim, self.value_heads,
                                          self.value_heads], dim=-1)
        beta = torch.sigmoid(b).float()
        g = -self.a_log.exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.value_heads, self.value_size, dtype=torch.float32,
                          device=x.device)
        if spans.fresh is not None:  # (sequences whose first token is in the step: zeros)
            states.conv.index_fill_(0, spans.fresh, 0.0)
            states.ssm.index_fill_(0, spans.fresh, 0.0)
        decodes = spans.num_decodes
        if decodes:
            rows = slice(0, decodes)
            slots = spans.slot_tensor[:decodes]
            conv, states.conv[slots] = conv_step(mixed[rows], states.conv[slots],
                                                 self.conv_weight)
            q, k, v = self.heads(F.silu(conv).to(x.dtype))
            o, ssm = recurrent_step(q, k, v, g[rows], beta[rows], states.ssm[slots])
            states.ssm[slots] = ssm
            out[rows] = o
        for i in range(decodes, len(spans.counts)):
            start, count, slot = spans.starts[i], spans.counts[i], spans.slots[i]
            rows = slice(start, start + count)
            conv, states.conv[slot] = conv_with_state(mixed[rows], states.conv[slot],
                                                      self.conv_weight)
            q, k, v = self.heads(F.silu(conv).to(x.dtype))
            o, ssm = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1),
                                        v.transpose(0, 1), g[rows].t(), beta[rows].t(),
                                        states.ssm[slot])
            states.ssm[slot] = ssm
            out[rows] = o.transpose(0, 1)
        return self.out_proj(self.gated_norm(out.to(x.dtype), z))

    def heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalized, q scaled, each key head repeated for its value heads) and v of
        the convolution's output ``[T, channels]``, per head, in float32."""
        n = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        group = self.value_heads // self.key_heads
        q, k = (l2_normalized(t.reshape(n, self.key_heads, self.key_size).float())
                for t in (q, k))
        if self.tiled:  # (value head j: key head j mod key heads)
            q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
        else:  # (value head j: key head j // group)
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return (q * self.key_size ** -0.5, k,
                v.reshape(n, self.value_heads, self.value_size).float())

    def gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each value head's output RMSNormed (weight ``w``), times ``silu(z)``
        (transformers' ``Qwen3_5RMSNormGated``), ``[T, value heads x value size]``."""
        n, dtype = out.shape[0], out.dtype
        h = out.reshape(-1, self.value_size).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm * h.to(dtype)
        h = h * F.silu(z.reshape(-1, self.value_size).float())
        return h.to(dtype).reshape(n, self.value_dim)
