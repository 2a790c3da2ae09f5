"""Apertus's xIELU activation (transformers' ``XIELUActivation``, the MLP activation of
``ApertusForCausalLM`` and Apertus 1.5's text model; llama.cpp's ``ggml_xielu``).

Apertus is Llama's model (``llama.py``) with per-head q/k RMSNorms before the rotation
(``ModelConfig.qk_norm``), an MLP without a gate, ``down(xielu(up(x)))``
(``ModelConfig.gated_mlp`` false, ``hidden_act`` ``xielu``), its norms under other names
(``weight_names.py``) and llama3 rope scaling by default (``config_apertus.py``). Each
layer's xIELU has four trained or stored scalars under ``mlp.act_fn.``: ``alpha_p`` and
``alpha_n`` (parameters of shape ``[1]``, through a softplus), ``beta`` and ``eps`` (buffers
of shape ``[]``); a GGUF file holds them as metadata (``gguf_apertus.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_apertus import XIELU_PARAMETERS


class XIELU:
    """One layer's xIELU, as transformers' ``XIELUActivation._xielu_python`` computes it in
    the dtype of the weights (a checkpoint's scalars are cast to the model's dtype as its
    other weights are; transformers' model holds them in its dtype too)::

        alpha_p = softplus(alpha_p), alpha_n = beta + softplus(alpha_n)
        x > 0:  alpha_p * x * x + beta * x
        else:   (expm1(min(x, eps)) - x) * alpha_n + beta * x
    """

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        """The scalars popped from ``weights`` under ``prefix`` (``model.layers.{i}.mlp.
        act_fn.``); a missing one is a ``KeyError`` (the loader names it), one that is not a
        single value a ``ModelLoadError`` naming it."""
        values = {}
        for name in XIELU_PARAMETERS:
            value = weights.pop(prefix + name)
            if value.numel() != 1:
                raise ModelLoadError(f"{prefix}{name} has shape {list(value.shape)}; xIELU's "
                                     f"{name} is one value a layer")
            values[name] = value.reshape(())
        self.beta, self.eps = values["beta"], values["eps"]
        self.alpha_p = F.softplus(values["alpha_p"])
        self.alpha_n = self.beta + F.softplus(values["alpha_n"])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        beta_x = self.beta * x
        return torch.where(x > 0, self.alpha_p * x * x + beta_x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * self.alpha_n + beta_x)
