"""The mixture-of-experts MLP (transformers' Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss sparse
MoE blocks, llama.cpp's ``build_moe_ffn`` with softmax gating), computed as transformers
computes it:

- the router, a linear of ``num_experts`` outputs, gives each token logits; their softmax
  (float32) gives probabilities, of which the top ``num_experts_per_tok`` are kept (the
  weights), rescaled to sum to 1 where ``norm_topk_prob`` (Mixtral always), times
  ``routed_scaling_factor``; gpt-oss's router (with a bias) keeps the top k logits and
  their softmax is the weights (``expert_gating`` ``softmax_weight``); LFM2-MoE's takes each
  logit's sigmoid, chooses the top k of those plus a per-expert bias (``mlp.expert_bias``)
  and rescales the chosen sigmoids to sum to 1 (plus ``expert_norm_eps``: ``sigmoid``);
- each expert is a SwiGLU MLP (its gate and up projections one linear; gpt-oss's with
  biases and its clamped SwiGLU, ``swiglu_oai``); the block's output is the sum over a
  token's chosen experts of weight x expert output, added expert by expert in the experts'
  order (``index_add_``, as transformers adds them);
- Qwen2-MoE's shared expert, a SwiGLU MLP every token goes through, is added last, times
  the sigmoid of its gate (a linear of one output).

Each expert computes the rows of the tokens that chose it, as one linear call; every row's
result depends on its own input only (the linears are batch-invariant where they compute
from GGUF blocks), and a token's sum runs in the experts' order, so a token's output does
not depend on the other tokens of its step. Where every expert computes from GGUF blocks on
the native CPU path, the experts run in one native call (``moe_experts``, kernels/csrc/
moe.cpp: the same kernels in the same order, bit for bit) instead of ~6 operator dispatches
an expert from Python.

The weights, by Hugging Face name under the layer's prefix: ``mlp.gate.weight`` and
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE, and what the GGUF reader names
every file's experts); Mixtral's ``block_sparse_moe.gate.weight`` and
``block_sparse_moe.experts.{e}.w1 / w3 / w2.weight``; or transformers 5's fused
``mlp.experts.gate_up_proj`` ``[experts, 2 x size, hidden]`` and ``mlp.experts.down_proj``
``[experts, hidden, size]``; gpt-oss's ``mlp.router.weight`` / ``.bias`` and its fused
experts (``_gpt_oss_experts``), or from GGUF the per-expert names above with ``.bias`` too;
the shared expert's ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
``mlp.shared_expert_gate.weight`` (``[1, hidden]``, or ``[hidden]`` as GGUF has it).
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.layers import gelu_tanh_and_mul, silu_and_mul
from freetoken_core.models.linear import BlockArena, Linear, make_linear

# One expert's weights: gate, up and down projections, and their biases (None: none).
ExpertWeights = tuple[Any, Any, Any, Any, Any, Any]


def _expert_weights(weights: dict[str, Any], prefix: str, num_experts: int
                    ) -> tuple[Any, Any, list[ExpertWeights]]:
    """The router's weight and bias (None where it has none) and each expert's weights,
    popped from ``weights`` in whichever of the namings the checkpoint has."""
    if prefix + "block_sparse_moe.gate.weight" in weights:  # Mixtral's checkpoints
        moe = prefix + "block_sparse_moe."
        return weights.pop(moe + "gate.weight"), None, [
            (*(weights.pop(f"{moe}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2")),
             None, None, None) for e in range(num_experts)]
    mlp = prefix + "mlp."
    if mlp + "router.weight" in weights:  # gpt-oss's checkpoints
        return (weights.pop(mlp + "router.weight"), weights.pop(mlp + "router.bias"),
                _gpt_oss_experts(weights, mlp, num_experts))
    router, router_bias = weights.pop(mlp + "gate.weight"), weights.pop(mlp + "gate.bias", None)
    if mlp + "experts.gate_up_proj" in weights:  # transformers 5's fused experts
        gate_up, down = weights.pop(mlp + "experts.gate_up_proj"), weights.pop(
            mlp + "experts.down_proj")
        if gate_up.dim() != 3 or gate_up.shape[0] != num_experts or gate_up.shape[1] % 2:
            raise ModelLoadError(f"{mlp}experts.gate_up_proj has shape "
                                 f"{list(gate_up.shape)}; expected [{num_experts}, 2 x "
                                 "expert size, hidden]")
        return router, router_bias, [(*gate_up[e].chunk(2), down[e], None, None, None)
                                     for e in range(num_experts)]
    if mlp + "experts.up_proj" in weights:  # (transformers 5's, ungated: Nemotron-H's)
        up, down = weights.pop(mlp + "experts.up_proj"), weights.pop(mlp + "experts.down_proj")
        return router, router_bias, [(None, up[e], down[e], None, None, None)
                                     for e in range(num_experts)]

    return router, router_bias, [_named_expert(weights, mlp, e) for e in range(num_experts)]


def _named_expert(weights: dict[str, Any], mlp: str, e: int) -> ExpertWeights:
    """Expert ``e``'s weights by their per-expert names (``experts.{e}.gate_proj`` ...,
    or a GGUF file's fused ``gate_up_proj``), popped from ``weights``."""
    names = [f"{mlp}experts.{e}.{w}_proj" for w in ("gate", "up", "down")]
    fused = f"{mlp}experts.{e}.gate_up_proj"
    if fused + ".weight" in weights:  # (a GGUF file's ffn_gate_up_exps: gate rows first)
        gate_up, bias = weights.pop(fused + ".weight"), weights.pop(fused + ".bias", None)
        half = gate_up.shape[0] // 2
        gate, up = ((gate_up.take_rows(0, half), gate_up.take_rows(half, 2 * half))
                    if hasattr(gate_up, "take_rows") else gate_up.chunk(2))
        biases = (None, None) if bias is None else bias.chunk(2)
        return (gate, up, weights.pop(names[2] + ".weight"), *biases,
                weights.pop(names[2] + ".bias", None))
    gate = weights.pop(names[0] + ".weight", None)  # (None: an ungated expert)
    return (gate, *(weights.pop(n + ".weight") for n in names[1:]),
            *(weights.pop(n + ".bias", None) for n in names))


def _gpt_oss_experts(weights: dict[str, Any], mlp: str, num_experts: int
                     ) -> list[ExpertWeights]:
    """gpt-oss's experts as transformers holds them: ``gate_up_proj`` ``[experts, hidden, 2
    x size]`` with the gate and up columns interleaved (gate first) and its bias ``[experts,
    2 x size]``, ``down_proj`` ``[experts, size, hidden]`` and its bias ``[experts,
    hidden]``: each expert's weights transposed to a linear's ``[out, in]``, the gate and up
    rows de-interleaved. Or per-expert weights by name (a GGUF file's, and the released
    checkpoints' MXFP4 experts as ``mxfp4.split_experts`` makes them)."""
    experts = mlp + "experts."
    if experts + "gate_up_proj" not in weights:
        return [_named_expert(weights, mlp, e) for e in range(num_experts)]
    gate_up, gate_up_bias = weights.pop(experts + "gate_up_proj"), weights.pop(
        experts + "gate_up_proj_bias")
    down, down_bias = weights.pop(experts + "down_proj"), weights.pop(
        experts + "down_proj_bias")
    if gate_up.dim() != 3 or gate_up.shape[0] != num_experts or gate_up.shape[2] % 2:
        raise ModelLoadError(f"{experts}gate_up_proj has shape {list(gate_up.shape)}; "
                             f"expected [{num_experts}, hidden, 2 x expert size]")
    return [(gate_up[e][:, 0::2].t().contiguous(), gate_up[e][:, 1::2].t().contiguous(),
             down[e].t().contiguous(), gate_up_bias[e][0::2].contiguous(),
             gate_up_bias[e][1::2].contiguous(), down_bias[e].contiguous())
            for e in range(num_experts)]


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of the fused ``[gate | up]`` output, as transformers'
    ``GptOssExperts._apply_gate``: the gate clamped to at most ``limit``, the up projection
    to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(gate * alpha)``."""
    gate, up = x.chunk(2, -1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoE:
    """One layer's mixture-of-experts MLP (module docstring): ``moe(x)`` is its output."""

    gelu_tanh = False
    """The experts' activation is GELU-tanh-and-mul (Gemma 4's), not SwiGLU."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], prefix: str, native: bool,
                 arena: BlockArena | None = None) -> None:
        router, router_bias, experts = _expert_weights(weights, prefix, cfg.num_experts)
        if tuple(router.shape) != (cfg.num_experts, cfg.hidden_size):
            raise ModelLoadError(f"{prefix}: the router's weight has shape "
                                 f"{list(router.shape)}; expected [{cfg.num_experts}, "
                                 f"{cfg.hidden_size}] (num_experts, hidden_size)")
        if cfg.expert_bias and (router_bias is None or any(b is None for e in experts
                                                            for b in e[3:])):
            raise ModelLoadError(f"{prefix}: {cfg.architecture}'s router and experts have "
                                 "biases; the checkpoint lacks some of them")
        self.router = make_linear([router], router_bias, arena=arena)
        self.gated = experts[0][0] is not None  # (ungated: act(up x), Nemotron-H's ReLU²)
        if any((gate is not None) != self.gated for gate, *_ in experts):
            raise ModelLoadError(f"{prefix}: some experts have a gate projection, others not")
        self.experts: list[tuple[Linear, Linear]] = [
            (make_linear([gate, up] if self.gated else [up],
                         None if up_b is None else torch.cat([gate_b, up_b]) if self.gated
                         else up_b, arena=arena), make_linear([down], down_b, arena=arena))
            for gate, up, down, gate_b, up_b, down_b in experts]
        self.shared: tuple[Linear, Linear] | None = None
        self.shared_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            # (Qwen2-MoE's shared_expert and its gate; GLM-4.5's and Nemotron-H's
            # shared_experts, not gated by a sigmoid; Nemotron-H's without a gate projection)
            gated = prefix + "mlp.shared_expert.gate_proj.weight" in weights
            mlp = prefix + ("mlp.shared_expert" if gated else "mlp.shared_experts")
            gate_proj = weights.pop(f"{mlp}.gate_proj.weight", None)
            self.shared = (make_linear(([gate_proj] if gate_proj is not None else [])
                                       + [weights.pop(f"{mlp}.up_proj.weight")], arena=arena),
                           make_linear([weights.pop(f"{mlp}.down_proj.weight")], arena=arena))
            if gated:
                gate = weights.pop(f"{mlp}_gate.weight")
                self.shared_gate = make_linear([gate.reshape(1, -1) if isinstance(
                    gate, torch.Tensor) else gate], arena=arena)
        self.selection_bias = None
        if cfg.expert_selection_bias:  # (LFM2-MoE's, GLM-4.5's, ERNIE 4.5's: to choose only)
            self.selection_bias = weights.pop(prefix + "mlp.expert_bias").float().reshape(-1)
            if tuple(self.selection_bias.shape) != (cfg.num_experts,):
                raise ModelLoadError(f"{prefix}mlp.expert_bias has shape "
                                     f"{list(self.selection_bias.shape)}; expected "
                                     f"[{cfg.num_experts}]")
        self.norm_eps = cfg.expert_norm_eps
        self.groups = cfg.expert_groups if cfg.expert_groups[:1] != (1,) and (
            cfg.expert_groups) else None
        self.group_by_max = cfg.expert_group_by_max
        self.top_k = cfg.num_experts_per_tok
        self.gating = cfg.expert_gating
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit else None
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.native = native
        self.native_args: tuple[Any, ...] | None = None
        self.set_native_args()

    def set_native_args(self) -> None:
        """``moe_experts``' arguments for the experts (their blocks and type ids, biases and
        gpt-oss's SwiGLU constants), made again whenever the blocks move (the model's
        ``set_all_layers_args``); None where an expert has no blocks (the Python loop
        computes them)."""
        linears = [lin for pair in self.experts for lin in pair]
        self.native_args = None
        biased = [lin.bias is not None for lin in linears]
        if self.native and self.gated and (all(biased) or not any(biased)) and all(
                lin.blocks is not None and lin.post is None for lin in linears):
            alpha, limit = self.swiglu or (0.0, 0.0)
            self.native_args = ([gu.blocks[1] for gu, _ in self.experts],
                                [gu.blocks[0] for gu, _ in self.experts],
                                [down.blocks[1] for _, down in self.experts],
                                [down.blocks[0] for _, down in self.experts],
                                [gu.bias for gu, _ in self.experts] if any(biased) else [],
                                [down.bias for _, down in self.experts] if any(biased) else [],
                                alpha, limit, self.gelu_tanh)

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The router's, every expert's and the shared expert's linears (for the model's
        block layouts)."""
        shared = (*self.shared, *([self.shared_gate] if self.shared_gate else [])
                  ) if self.shared is not None else ()
        return (self.router, *(lin for pair in self.experts for lin in pair), *shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: the experts each token's output
        sums, by descending probability, and their weights (in ``x``'s dtype)."""
        logits = self.router(x).float()
        if self.gating == "softmax_weight":  # the top k logits, then their softmax
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        elif self.gating == "sigmoid":  # each expert's sigmoid; chosen with a bias, if any
            scores = torch.sigmoid(logits)
            choice = scores if self.selection_bias is None else scores + self.selection_bias
            if self.groups is not None:  # (only the experts of the best groups)
                choice = self.best_groups(choice)
            chosen = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, chosen)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        else:
            probs = torch.softmax(logits, dim=-1)
            if self.groups is not None:  # (DeepSeek-V2's group_limited_greedy)
                chosen = torch.topk(self.best_groups(probs), self.top_k, dim=-1).indices
                weights = probs.gather(1, chosen)
            elif self.selection_bias is None:
                weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            else:  # (ERNIE 4.5's: chosen by the probabilities plus the bias, weighted by them)
                chosen = torch.topk(probs + self.selection_bias, self.top_k, dim=-1).indices
                weights = probs.gather(1, chosen)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(x.dtype), chosen

    def best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` ``[tokens, experts]`` with every expert outside each token's best
        ``topk_group`` groups at -inf, a group's score the sum of its two best (DeepSeek-V3's
        and GLM-4.5's group-limited routing, ``n_group`` groups of consecutive experts) or
        its best (DeepSeek-V2's, ``expert_group_by_max``)."""
        groups, keep = self.groups
        grouped = choice.view(choice.shape[0], groups, -1)
        scores = (grouped.max(dim=-1).values if self.group_by_max
                  else grouped.topk(2, dim=-1).values.sum(dim=-1))
        best = scores.topk(keep, dim=-1).indices
        mask = torch.zeros(choice.shape[0], groups, dtype=torch.bool, device=choice.device)
        mask.scatter_(1, best, True)
        return grouped.masked_fill(~mask[..., None], float("-inf")).view_as(choice)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = self.experts_sum(x, weights, chosen)
        if self.shared is None:
            return out
        gate_up, down = self.shared
        shared = down(self.activation(gate_up(x)))
        if self.shared_gate is None:
            return out + shared
        return out + torch.sigmoid(self.shared_gate(x)) * shared

    def experts_sum(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                    ) -> torch.Tensor:
        """Each token's sum of its ``chosen`` experts' outputs times their ``weights``: in
        one native call where the experts compute from GGUF blocks, else ``loop``."""
        if self.native_args is not None:
            return torch.ops.freetoken.moe_experts(x.contiguous(), chosen, weights,
                                                   *self.native_args)
        return self.loop(x, weights, chosen)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """An expert's activation of its fused ``[gate | up]`` output: SwiGLU, gpt-oss's
        clamped one, or GELU-tanh-and-mul (Gemma 4's); of an ungated expert's ``up`` output,
        ReLU² (Nemotron-H's)."""
        if not self.gated:
            return torch.square(torch.relu(gate_up))
        if self.gelu_tanh:
            return gelu_tanh_and_mul(gate_up)
        if self.swiglu is not None:
            return swiglu_oai(gate_up, *self.swiglu)
        return silu_and_mul(gate_up, self.native)

    def loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
             ) -> torch.Tensor:
        """The experts' sum from Python, expert by expert (what ``moe_experts`` computes)."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = torch.div(order, chosen.shape[1], rounding_mode="floor")
        pair_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for (gate_up, down), count in zip(self.experts, counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            h = down(self.activation(gate_up(x.index_select(0, rows))))
            out.index_add_(0, rows, h * pair_weights[start:start + count, None])
            start += count
        return out


class SwiGluMlp:
    """A dense SwiGLU MLP (``mlp.{gate,up,down}_proj``, no biases), its gate and up one
    linear: ``mlp(x)`` is ``down(silu(gate x) * up x)``."""

    def __init__(self, weights: dict[str, Any], prefix: str, native: bool,
                 arena: BlockArena | None = None) -> None:
        mlp = prefix + "mlp."
        self.gate_up_proj = make_linear([weights.pop(mlp + "gate_proj.weight"),
                                         weights.pop(mlp + "up_proj.weight")], arena=arena)
        self.down_proj = make_linear([weights.pop(mlp + "down_proj.weight")], arena=arena)
        self.linears = (self.gate_up_proj, self.down_proj)
        self.native = native

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.native))


def feed_forward(cfg: ModelConfig, weights: dict[str, Any], prefix: str, index: int,
                 native: bool, arena: BlockArena | None = None) -> SparseMoE | SwiGluMlp:
    """Layer ``index``'s MLP: its experts where ``cfg.is_moe_layer(index)``, else a
    :class:`SwiGluMlp`."""
    if cfg.is_moe_layer(index):
        return SparseMoE(cfg, weights, prefix, native, arena)
    return SwiGluMlp(weights, prefix, native, arena)
