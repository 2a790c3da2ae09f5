"""Mamba-2, the state-space mixer of Granite 4's ``mamba`` layers, Nemotron-H's and Falcon-H1's
(transformers' ``GraniteMoeHybridMambaLayer``, ``NemotronHMamba2Mixer``, ``FalconH1Mixer``:
the same computation, Falcon-H1's with multipliers, ``falcon_h1.py``), over per-sequence
states (``recurrent``).

A layer keeps, per sequence, its convolution's last ``kernel - 1`` inputs (``conv``) and a
state per head (``ssm`` ``[heads, head size, state size]``, float32). A token's computation, as
transformers computes it:

- one projection gives the gate ``z`` (``expand x hidden``), ``xBC`` (the convolution's
  channels: ``x`` then ``B`` and ``C``, ``groups x state size`` each) and ``dt`` (a number a
  head);
- ``xBC`` through a causal depthwise convolution (with its bias) over the sequence's last
  ``kernel`` inputs, then SiLU;
- ``dt = softplus(dt + dt_bias)`` (clamped to ``time_step_limit``), ``A = -exp(A_log)``: the
  state decays by ``exp(dt A)`` and takes ``dt B x^T`` (each group's B and C serving
  ``heads / groups`` heads); the output is ``S C + D x``;
- times ``silu(z)``, RMSNormed in ``groups`` groups (weight ``w``), then the out projection
  (``ModelConfig.mamba_norm``: Falcon-H1's norm before the gate, or none).

A prompt chunk runs the chunked form (transformers' ``mamba2_chunk_scan``: the same
recurrence in blocks of ``chunk_size`` tokens) from its sequence's state, or from zeros where
the chunk is its start; the step's decoding sequences update their states together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import SequenceSpans
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gated_deltanet import RecurrentStates
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.recurrent import conv_step, conv_with_state


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j + 1:i + 1])`` below the diagonal (0 on it), -inf
    above (transformers' ``segment_sum``)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device),
                                  diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool,
                                                  device=x.device)), -torch.inf)


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, state: torch.Tensor, chunk: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan in blocks of ``chunk`` tokens: ``x`` ``[T, heads, head size]``,
    ``dt`` ``[T, heads]`` (after softplus), ``a`` ``[heads]``, ``b`` / ``c`` ``[T, heads, state
    size]`` (float32), from ``state`` ``[heads, head size, state size]``; the outputs
    ``[T, heads, head size]`` (without ``D x``) and the final state."""
    length = x.shape[0]
    pad = (chunk - length % chunk) % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk, *t.shape[1:])

    x = x * dt[..., None]
    a = a * dt  # [T, heads]
    x, a, b, c = (chunks(t) for t in (x, a, b, c))  # [n, l, heads(, ...)]
    a = a.permute(2, 0, 1)  # [heads, n, l]
    a_cum = torch.cumsum(a, dim=-1)
    decay = torch.exp(_segment_sum(a))  # [heads, n, l, s]
    scores = torch.einsum("clhn,cshn->clsh", c, b) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    b_decay = b * torch.exp(a_cum[:, :, -1:] - a_cum).permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", b_decay, x)
    states = torch.cat([state[None].to(states.dtype), states], dim=0)
    chunk_decay = torch.exp(_segment_sum(F.pad(a_cum[:, :, -1], (1, 0))))  # [heads, z, c]
    states = torch.einsum("hcz,zhpn->chpn", chunk_decay, states)
    states, final = states[:-1], states[-1]
    y_off = torch.einsum("clhn,chpn->clhp", c, states) * torch.exp(a_cum).permute(
        1, 2, 0)[..., None]
    return (y_diag + y_off).reshape(-1, *x.shape[2:])[:length], final


class Mamba2:
    """Layer ``prefix``'s Mamba-2 mixer (module docstring), by transformers' names under
    ``mamba.``: ``in_proj``, ``conv1d`` (and its bias), ``dt_bias``, ``A_log``, ``D``,
    ``norm``, ``out_proj``."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], prefix: str,
                 arena: BlockArena | None, name: str = "mamba") -> None:
        p = f"{prefix}{name}."  # (Nemotron-H's: mixer)
        (self.heads, self.head_size, self.groups, self.state_size, self.kernel,
         self.chunk) = cfg.mamba_shape
        self.inner = self.heads * self.head_size
        self.channels = self.inner + 2 * self.groups * self.state_size
        self.in_proj = make_linear([weights.pop(p + "in_proj.weight")],
                                   weights.pop(p + "in_proj.bias", None), arena=arena)
        self.out_proj = make_linear([weights.pop(p + "out_proj.weight")],
                                    weights.pop(p + "out_proj.bias", None), arena=arena)
        if self.in_proj.out_features != self.inner + self.channels + self.heads:
            raise ModelLoadError(f"{p}in_proj has {self.in_proj.out_features} outputs; the "
                                 "config's Mamba shape needs "
                                 f"{self.inner + self.channels + self.heads}")
        conv = weights.pop(p + "conv1d.weight")
        if tuple(conv.shape) not in ((self.channels, 1, self.kernel),
                                     (self.channels, self.kernel)):
            raise ModelLoadError(f"{p}conv1d.weight has shape {list(conv.shape)}; expected "
                                 f"[{self.channels}, 1, {self.kernel}]")
        self.conv_weight = conv.reshape(self.channels, 1, self.kernel)
        self.conv_bias = weights.pop(p + "conv1d.bias", None)
        self.dt_bias = weights.pop(p + "dt_bias")
        self.a = -torch.exp(weights.pop(p + "A_log").float())
        self.d = weights.pop(p + "D")
        self.norm_kind = cfg.mamba_norm
        self.norm = None if self.norm_kind == "none" else weights.pop(p + "norm.weight")
        self.dt_limit = cfg.mamba_time_step_limit
        self.eps = cfg.rms_norm_eps
        self.linears = (self.in_proj, self.out_proj)

    def state_bytes(self, dtype: torch.dtype) -> int:
        return (self.channels * (self.kernel - 1) * dtype.itemsize
                + self.heads * self.head_size * self.state_size * 4)

    def states(self, slots: int, dtype: torch.dtype, device: torch.device) -> RecurrentStates:
        return RecurrentStates(slots, self.channels, self.kernel, self.heads, self.head_size,
                               self.state_size, dtype, device)

    def __call__(self, x: torch.Tensor, states: RecurrentStates, spans: SequenceSpans
                 ) -> torch.Tensor:
        """The mixer's output for the normed ``x`` ``[T, hidden]`` of the step's sequences
        (``spans``), their states read and written in place."""
        z, xbc, dt = self.project(x).split([self.inner, self.channels, self.heads], dim=-1)
        # (transformers clamps dt to time_step_limit in its chunked form only)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        out = torch.empty(x.shape[0], self.heads, self.head_size, dtype=torch.float32,
                          device=x.device)
        if spans.fresh is not None:
            states.conv.index_fill_(0, spans.fresh, 0.0)
            states.ssm.index_fill_(0, spans.fresh, 0.0)
        decodes = spans.num_decodes
        if decodes:
            slots = spans.slot_tensor[:decodes]
            conv, states.conv[slots] = conv_step(xbc[:decodes], states.conv[slots],
                                                 self.conv_weight, self.conv_bias)
            h, b, c = self.split(F.silu(conv).to(x.dtype))
            step = dt[:decodes].float()[..., None, None]  # [D, heads, 1, 1]
            ssm = states.ssm[slots] * torch.exp(step * self.a[:, None, None]) + (
                step * b[:, :, None, :] * h[..., None])
            states.ssm[slots] = ssm
            out[:decodes] = (ssm @ c[..., None])[..., 0] + self.d.float()[:, None] * h
        for i in range(decodes, len(spans.counts)):
            start, count, slot = spans.starts[i], spans.counts[i], spans.slots[i]
            rows = slice(start, start + count)
            conv, states.conv[slot] = conv_with_state(xbc[rows], states.conv[slot],
                                                      self.conv_weight, self.conv_bias)
            h, b, c = self.split(F.silu(conv).to(x.dtype))
            y, states.ssm[slot] = chunk_scan(h, dt[rows].float().clamp(*self.dt_limit), self.a,
                                             b, c,
                                             states.ssm[slot], self.chunk)
            out[rows] = y + self.d.float()[:, None] * h
        return self.out_proj(self.gated_norm(out, z).to(x.dtype))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The in projection of ``x``: ``z``, ``xBC`` and ``dt`` side by side."""
        return self.in_proj(x)

    def split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, heads, head size]``, ``B`` and ``C`` ``[T, heads, state size]`` (each
        group's repeated for its heads) of the convolution's output, in float32."""
        n = conv.shape[0]
        h, b, c = conv.split([self.inner, self.groups * self.state_size,
                              self.groups * self.state_size], dim=-1)
        per_group = self.heads // self.groups
        b, c = (t.float().reshape(n, self.groups, self.state_size)
                .repeat_interleave(per_group, dim=1) for t in (b, c))
        return h.float().reshape(n, self.heads, self.head_size), b, c

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The scan's output ``y`` ``[T, heads, head size]`` (float32, ``D x`` added) times
        ``silu(z)``, RMSNormed in ``groups`` groups, times the norm's weight (transformers'
        ``GraniteMoeHybridRMSNormGated``, in float32 as the scan's output is); normed before
        the gate, or not at all, as ``mamba_norm`` says (``FalconH1RMSNormGated``)."""
        n = y.shape[0]
        gate = F.silu(z.float())
        h = y.reshape(n, self.inner)
        if self.norm is None:
            return h * gate
        if self.norm_kind == "after_gate":
            h = h * gate
        h = h.view(n, self.groups, -1)
        h = self.norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).view(
            n, self.inner)
        return h * gate if self.norm_kind == "before_gate" else h
