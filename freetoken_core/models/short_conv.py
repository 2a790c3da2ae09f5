"""LFM2's gated short convolution (transformers' ``Lfm2ShortConv``), the token mixer of its
``conv`` layers, over per-sequence convolution states (``recurrent``): one projection gives
``B``, ``C`` and ``x`` (each ``hidden`` wide); ``B * x`` goes through a causal depthwise
convolution over the sequence's last ``kernel`` inputs (``conv_L_cache``, 3; zeros before its
first token; a bias where ``conv_bias``), no activation; the output is ``out_proj(C * conv)``.
A sequence's state is the convolution's last ``kernel - 1`` inputs."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import SequenceSpans
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_weights import GGUFWeight
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.recurrent import conv_step, conv_with_state


class ShortConv:
    """Layer ``prefix``'s short convolution, by transformers' names under ``conv.``:
    ``in_proj``, ``conv`` (``[hidden, 1, kernel]``, or ``[hidden, kernel]`` as a GGUF file
    squeezes it; its bias where the config has one),
    ``out_proj`` (and their biases where ``conv_bias``)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], prefix: str,
                 arena: BlockArena | None) -> None:
        p = prefix + "conv."
        self.hidden, self.kernel = cfg.hidden_size, cfg.short_conv_kernel
        self.in_proj = make_linear([weights.pop(p + "in_proj.weight")],
                                   weights.pop(p + "in_proj.bias", None), arena=arena)
        self.out_proj = make_linear([weights.pop(p + "out_proj.weight")],
                                    weights.pop(p + "out_proj.bias", None), arena=arena)
        conv = weights.pop(p + "conv.weight")
        if isinstance(conv, GGUFWeight):  # (a GGUF file's, [hidden, kernel]: gguf_lfm2.py)
            conv = conv.dequantize()
        if tuple(conv.shape) not in ((self.hidden, 1, self.kernel), (self.hidden, self.kernel)):
            raise ModelLoadError(f"{p}conv.weight has shape {list(conv.shape)}; expected "
                                 f"[{self.hidden}, 1, {self.kernel}] (conv_L_cache)")
        self.weight = conv.reshape(self.hidden, 1, self.kernel)
        self.bias = weights.pop(p + "conv.bias", None)
        if self.in_proj.out_features != 3 * self.hidden:
            raise ModelLoadError(f"{p}in_proj has {self.in_proj.out_features} outputs; "
                                 f"expected 3 x hidden = {3 * self.hidden}")
        self.linears = (self.in_proj, self.out_proj)

    def state_bytes(self, dtype: torch.dtype) -> int:
        return self.hidden * (self.kernel - 1) * dtype.itemsize

    def states(self, slots: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[slots, hidden, kernel - 1]``: each sequence's last inputs."""
        return torch.zeros(slots, self.hidden, self.kernel - 1, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, states: torch.Tensor, spans: SequenceSpans
                 ) -> torch.Tensor:
        """The mixer's output for the normed ``x`` ``[T, hidden]`` of the step's sequences
        (``spans``), their states read and written in place."""
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        h = b * h
        out = torch.empty_like(h)
        if spans.fresh is not None:
            states.index_fill_(0, spans.fresh, 0.0)
        decodes = spans.num_decodes
        if decodes:
            slots = spans.slot_tensor[:decodes]
            conv, states[slots] = conv_step(h[:decodes], states[slots], self.weight, self.bias)
            out[:decodes] = conv.to(h.dtype)
        for i in range(decodes, len(spans.counts)):
            start, count, slot = spans.starts[i], spans.counts[i], spans.slots[i]
            conv, states[slot] = conv_with_state(h[start:start + count], states[slot],
                                                 self.weight, self.bias)
            out[start:start + count] = conv.to(h.dtype)
        return self.out_proj(c * out)
