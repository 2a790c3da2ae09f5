"""Building blocks of the native models: RMSNorm, Cohere's LayerNorm, RoPE, gated
activations (the linears and their GGUF blocks are ``linear.py``'s and
``block_layout.py``'s)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             native: bool = False) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as Hugging Face's Llama does.

    ``native``: one fused pass (``freetoken_core/kernels``) over a 2-d contiguous ``x``.
    """
    if native:
        out = torch.empty_like(x)
        torch.ops.freetoken.rms_norm(out, x, weight, eps)
        return out
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` and its RMSNorm: the block's skip connection and the
    next norm in one step. ``native`` overwrites ``x`` and ``residual`` in place."""
    if native:
        torch.ops.freetoken.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm (transformers' ``CohereLayerNorm``), op for op: in float32, the
    mean subtracted and divided by the square root of the variance plus ``eps``, times
    ``weight`` (no bias), cast back. ``weight`` broadcasts over the trailing dimensions
    (Command R+'s q/k norms: one ``[heads, head_dim]`` weight, each head normed alone)."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (weight.float() * h).to(x.dtype)


def silu_and_mul(x: torch.Tensor, native: bool = False) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of the fused ``[gate | up]`` projection output."""
    if native:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops.freetoken.silu_and_mul(out, x)
        return out
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with linear, llama3 or YaRN scaling (Hugging Face's formulas), or
    ``factors``: a GGUF file's per-pair frequency factors (``rope_freqs.weight``, which
    llama.cpp's converter computes from llama3 scaling), each pair's frequency divided by its
    factor (and by a linear ``factor`` if given), as llama.cpp's ``ggml_rope_ext`` does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ModelLoadError(f"rope frequency factors: {len(scaling['factors'])} of them "
                                 f"for {head_dim // 2} rotary pairs")
        return inv_freq / factors / scaling.get("factor", 1.0)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if kind == "proportional":
        # (Gemma 4's global layers, transformers' _compute_proportional_rope_parameters: the
        # first partial_rotary_factor of the pairs turn, the others keep frequency 0)
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / scaling.get("factor", 1.0)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}; FreeToken knows "
                         "default, linear, llama3, yarn, proportional and (from GGUF) "
                         "factors")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float,
                   scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``; llama.cpp's
    ``rope_yarn`` with its default betas): pair ``i`` turns at the scaled frequency
    ``inv_freq / factor`` below the ramp, at its own above it, linearly mixed between the
    pairs that make ``beta_fast`` and ``beta_slow`` turns over the original length
    (floored and ceiled unless ``truncate`` is false)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(turns: float) -> float:
        return (head_dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by: ``attention_factor`` if given, else
    ``0.1 ln(factor) + 1`` (over the same with ``mscale_all_dim``, times ``mscale``, where
    both are given), as transformers computes it; 1 for every other scaling."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(value: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * value * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


class RotaryEmbedding:
    """Precomputed cos/sin tables in Hugging Face's half-rotation layout (times YaRN's
    attention factor where the scaling is YaRN)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(scaling)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for ``positions``, shaped ``[T, head_dim]``."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               native: bool = False) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, head_dim]) by the ``[T, head_dim]`` tables; ``native``
    rotates in place."""
    if native:
        torch.ops.freetoken.rotary_embedding(x, cos, sin)
        return x
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's ``gelu_tanh(gate) * up`` of the fused ``[gate | up]`` projection output
    (transformers' ``gelu_pytorch_tanh``, Gemma's MLP)."""
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


def float32_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            native: bool = False) -> torch.Tensor:
    """RMSNorm with a float32 ``weight`` multiplied in float32 before the one cast back, as
    Hugging Face's Gemma RMSNorm computes ``x * (1 + w)`` (``weight`` holds ``1 + w``). In
    float32 that is ``rms_norm``'s arithmetic, so the native kernel computes it there."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps, native)
    return (torch.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(x.dtype)


def float32_weight_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, native: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with ``float32_weight_rms_norm``'s rounding."""
    if x.dtype == torch.float32:
        return add_rms_norm(x, residual, weight, eps, native)
    residual = x + residual
    return float32_weight_rms_norm(residual, weight, eps), residual
