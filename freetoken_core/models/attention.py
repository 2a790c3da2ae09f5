"""Attention over the paged KV cache, in torch (any device).

A step's tokens are laid out flat: first the decoding sequences (one query token each),
then each prefilling sequence's chunk. ``AttentionMetadata`` is built once per step by the
model runner and shared by every layer.

Two paths with the same result: on CPU, the native kernel (``freetoken_core/kernels``)
computes every token, decoding or in a prefill chunk, as one query that reads its keys and
values in place, block by block, up to its own position; so a token's attention does not
depend on the rest of its step (batch-invariant). Elsewhere, or where the kernel cannot be
built, decoding gathers the keys and values into a padded batch and each prefill chunk is
one ``scaled_dot_product_attention`` call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's chunk: tokens ``start:end`` of the step, ``context_len`` keys in all.

    ``context_slots`` (KV-cache slots of all its keys) is ``None`` when the chunk is the
    whole context, so attention runs on the fresh keys without reading the cache.
    """

    start: int
    end: int
    context_len: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class SequenceSpans:
    """The step's sequences, in step order (decodes first), for layers that keep a state
    per sequence (``gated_deltanet``): each one's first row in the step, its tokens, the
    position of its first token (0: the sequence starts in this step) and its state slot
    (``Sequence.slot``)."""

    starts: list[int]
    counts: list[int]
    first_positions: list[int]
    slots: list[int]
    slot_tensor: torch.Tensor
    """``slots`` as a long tensor."""
    num_decodes: int
    """The leading sequences with one token each."""
    fresh: torch.Tensor | None
    """The slots of the sequences that start in this step (their states begin at zero);
    None: none does."""

    @classmethod
    def build(cls, context_lens: list[int], query_lens: list[int], slots: list[int],
              device: torch.device) -> SequenceSpans:
        starts, start = [], 0
        for count in query_lens:
            starts.append(start)
            start += count
        firsts = [ctx - q for ctx, q in zip(context_lens, query_lens)]
        decodes = 0
        while decodes < len(query_lens) and query_lens[decodes] == 1:
            decodes += 1
        fresh = [slot for slot, first in zip(slots, firsts) if first == 0]
        return cls(starts, list(query_lens), firsts, list(slots),
                   torch.tensor(slots, dtype=torch.long, device=device), decodes,
                   torch.tensor(fresh, dtype=torch.long, device=device) if fresh else None)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] cache slot of each token of the step, where its key and value are written."""
    num_decode_tokens: int
    decode_slots: torch.Tensor | None
    """torch path: [D, L] cache slots of every key of each decoding sequence, padded."""
    decode_mask: torch.Tensor | None
    """torch path: [D, 1, 1, L] True where the key exists (the rest is padding)."""
    decode_block_tables: torch.Tensor | None
    """native path: [T, W] int32 cache blocks of each token's sequence, padded."""
    decode_context_lens: torch.Tensor | None
    """native path: [T] int32 keys each token attends to, its own included."""
    block_size: int
    prefills: list[PrefillSpan]
    window: int | None = None
    """Sliding-window attention: each query attends to its last ``window`` keys, its own
    included (0 <= query position - key position < window); ``None``: to every key."""
    chunk: int | None = None
    """Chunked attention (Llama 4's ``attention_chunk_size``): each query attends to the keys
    of its own chunk of ``chunk`` positions, up to its own (key position // chunk == query
    position // chunk); ``None``: to every key. Never with a ``window``."""
    query_scales: torch.Tensor | None = None
    """[T] multipliers of each token's rotated query (Llama 4's attention temperature,
    Ministral 3's ``llama_4_scaling_beta``); ``None``: none (every multiplier 1)."""
    sequences: SequenceSpans | None = None
    """The step's sequences with their state slots, for models with recurrent layers
    (Qwen3.5's); ``None`` for the others."""

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int],
              query_lens: list[int], block_size: int, device: torch.device,
              native: bool = False) -> AttentionMetadata:
        """Metadata for sequences given in step order: all decodes (query 1) come first.

        ``native``: every token through the native CPU kernel (the model decides: it knows
        the device, the dtype and whether the kernels could be built).
        """
        slots: list[int] = []
        for table, ctx, q in zip(block_tables, context_lens, query_lens):
            for pos in range(ctx - q, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        if native:
            return cls._native(block_tables, context_lens, query_lens, block_size,
                               slot_mapping, device)
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1:
            num_decode += 1
        decode_slots = decode_mask = None
        if num_decode:
            decode_slots, decode_mask = _decode_slots(
                block_tables[:num_decode], context_lens[:num_decode], block_size, device)
        prefills = []
        start = num_decode
        for table, ctx, q in zip(block_tables[num_decode:], context_lens[num_decode:],
                                 query_lens[num_decode:]):
            ctx_slots = mask = None
            if ctx > q:
                ctx_slots = _slots_of(table, ctx, block_size, device)
                k_pos = torch.arange(ctx, device=device)
                q_pos = torch.arange(ctx - q, ctx, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]
            prefills.append(PrefillSpan(start, start + q, ctx, ctx_slots, mask))
            start += q
        return cls(slot_mapping, num_decode, decode_slots, decode_mask, None, None,
                   block_size, prefills)

    @classmethod
    def _native(cls, block_tables: list[list[int]], context_lens: list[int],
                query_lens: list[int], block_size: int, slot_mapping: torch.Tensor,
                device: torch.device) -> AttentionMetadata:
        """Every token of the step, prefill chunks included, as one query of the native
        kernel: its sequence's blocks and the keys up to its own position. A token's
        attention is then computed the same way whatever step it is in (alone, among other
        sequences, in a prefill chunk of any size, after a prefix-cache hit)."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                              dtype=torch.int32, device=device)
        if any(q != 1 for q in query_lens):
            tables = tables.repeat_interleave(
                torch.tensor(query_lens, device=device), dim=0)
            lens = torch.cat([torch.arange(ctx - q + 1, ctx + 1, dtype=torch.int32)
                              for ctx, q in zip(context_lens, query_lens)]).to(device)
        else:
            lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        return cls(slot_mapping, len(lens), None, None, tables, lens, block_size, [])

    def with_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for layers that attend to the last ``window`` keys only
        (the same step: built once per step, shared by those layers)."""
        if window == self.window and self.chunk is None:
            return self
        if window is not None and window < 1:
            raise ValueError(f"a sliding window needs at least one key, not {window}")
        return self._limited(window, None)

    def with_chunk(self, chunk: int | None) -> AttentionMetadata:
        """This step's metadata for layers whose queries attend within their own chunk of
        ``chunk`` positions only (Llama 4's chunked attention; built once per step, shared by
        those layers)."""
        if chunk == self.chunk and self.window is None:
            return self
        if chunk is not None and chunk < 1:
            raise ValueError(f"an attention chunk needs at least one position, not {chunk}")
        return self._limited(None, chunk)

    def _limited(self, window: int | None, chunk: int | None) -> AttentionMetadata:
        """This metadata with ``window`` and ``chunk`` (at most one of them) in place of its
        own: the native kernel takes them as they are, the torch path's masks are made
        again."""
        if self.decode_block_tables is not None:
            return replace(self, window=window, chunk=chunk)
        decode_mask = self.decode_mask
        if decode_mask is not None:
            # (each query's last key is its own, whatever window or chunk limits the mask)
            pos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
            lens = (decode_mask * (pos + 1)).amax(dim=-1, keepdim=True)
            decode_mask = pos < lens
            if window is not None:
                decode_mask = decode_mask & (pos >= lens - window)
            if chunk is not None:  # (the query is key lens - 1)
                decode_mask = decode_mask & (pos >= torch.div(lens - 1, chunk,
                                                              rounding_mode="floor") * chunk)
        prefills = [replace(span, mask=_prefill_mask(span, window, chunk,
                                                     self.slot_mapping.device))
                    for span in self.prefills]
        return replace(self, decode_mask=decode_mask, prefills=prefills, window=window,
                       chunk=chunk)


def _prefill_mask(span: PrefillSpan, window: int | None, chunk: int | None,
                  device: torch.device) -> torch.Tensor | None:
    """[chunk, context] True where a chunk token attends to a key: causal, and within
    ``window`` or within the token's attention ``chunk``; ``None`` for plain causal
    attention over the chunk alone."""
    if window is None and chunk is None and span.context_slots is None:
        return None
    q = span.end - span.start
    k_pos = torch.arange(span.context_len, device=device)
    q_pos = torch.arange(span.context_len - q, span.context_len, device=device)
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if chunk is not None:
        mask = mask & (torch.div(q_pos, chunk, rounding_mode="floor")[:, None]
                       == torch.div(k_pos, chunk, rounding_mode="floor")[None, :])
    return mask if window is None else mask & (diff < window)


def _slots_of(table: list[int], length: int, block_size: int, device: torch.device
              ) -> torch.Tensor:
    blocks = torch.tensor(table, dtype=torch.long, device=device)
    pos = torch.arange(length, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size


def _decode_slots(tables: list[list[int]], context_lens: list[int], block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    max_len = max(context_lens)
    width = -(-max_len // block_size)
    padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    blocks = torch.tensor(padded, dtype=torch.long, device=device)
    pos = torch.arange(max_len, device=device)
    slots = blocks[:, pos // block_size] * block_size + pos % block_size
    lens = torch.tensor(context_lens, dtype=torch.long, device=device)
    mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    return slots, mask


def _gather(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys and values of ``slots`` ([...] indices) as [..., 2, KVH, D], in ``dtype`` (the
    queries')."""
    flat = kv_cache.view(kv_cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, *kv_cache.shape[1:]).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            is_causal: bool, scale: float | None, sinks: torch.Tensor | None,
            softcap: float = 0.0) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q`` [B, H, Q, D] over ``k``, ``v`` [B, KVH, K,
    D] (grouped-query: each KV head serves H / KVH query heads); with ``sinks`` ([H]
    float32), each head's sink logit joins the softmax and takes its share of the weight
    with no value (transformers' gpt-oss eager attention: the scores and the sink, less
    their maximum, through a softmax, the sink's column dropped); with ``softcap`` > 0, the
    scaled scores become ``softcap * tanh(scores / softcap)`` before the mask and the
    softmax (transformers' Gemma 2 eager attention)."""
    if sinks is None and not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=True, scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                          device=q.device).tril(k.shape[-2] - q.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float | None = None,
                    sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Write the step's keys and values into the cache, then attend.

    ``q``: [T, H, D]; ``kv``: [T, 2, KVH, D] (keys, values); ``kv_cache``:
    [num_slots, 2, KVH, D], keys and values of a slot side by side so one gather reads
    both. ``scale`` multiplies the scores (``None``: 1/sqrt(D)); ``meta.window`` limits
    each query to its last keys; ``sinks`` ([H] float32) are the heads' attention sinks
    (gpt-oss: a logit per head in every query's softmax, with no value); ``softcap`` > 0
    bounds each scaled score to ``softcap * tanh(score / softcap)`` (Gemma 2's
    ``attn_logit_softcapping``; 0: none); ``meta.chunk`` limits each query to the keys of its
    own chunk of positions (Llama 4's chunked attention). Returns [T, H * D]. A cache of another dtype than ``q``'s (``kv_cache_dtype``) stores the keys and
    values rounded to it, and every query attends to the stored values, this step's too: a
    prompt's result is the same whether its prefix was computed in this chunk or found in
    the cache.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    if kv.dtype != kv_cache.dtype:
        kv = kv.to(kv_cache.dtype)
    kv_cache.index_copy_(0, meta.slot_mapping, kv)
    d = meta.num_decode_tokens
    if d and meta.decode_block_tables is not None:
        od = torch.empty(d, num_heads, head_dim, dtype=q.dtype, device=q.device)
        torch.ops.freetoken.paged_decode_attention(
            q[:d], kv_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, head_dim ** -0.5 if scale is None else scale, od,
            meta.window or 0, sinks, softcap, meta.chunk or 0)
        od = od.view(d, num_heads * head_dim)
        if not meta.prefills:
            return od
    elif d:
        # One query per sequence: fold each KV head's query heads into the query axis, so
        # grouped-query attention needs no repeated keys.
        group = num_heads // num_kv_heads
        qd = q[:d].view(d, num_kv_heads, group, head_dim)
        ctx = _gather(kv_cache, meta.decode_slots, q.dtype)  # [D, L, 2, KVH, D]
        kd, vd = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
        if sinks is None and not softcap:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                                scale=scale)
        else:  # (one query per sequence: the heads on the batch axis's side)
            od = _attend(q[:d].unsqueeze(2), kd, vd, meta.decode_mask, False, scale, sinks,
                         softcap)
        od = od.reshape(d, num_heads * head_dim)
        if not meta.prefills:
            return od
    out = torch.empty_like(q)
    if d:
        out[:d] = od.view(d, num_heads, head_dim)
    for span in meta.prefills:
        qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
        if span.context_slots is None:  # (the chunk's own keys, as the cache stores them)
            ctx = kv[span.start:span.end].to(q.dtype)
        else:
            ctx = _gather(kv_cache, span.context_slots, q.dtype)
        kp = ctx[:, 0].transpose(0, 1).unsqueeze(0)
        vp = ctx[:, 1].transpose(0, 1).unsqueeze(0)
        op = _attend(qp, kp, vp, span.mask, span.mask is None, scale, sinks, softcap)
        out[span.start:span.end] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
