"""Apertus GGUF files (``general.architecture`` ``apertus``), as llama.cpp's converter writes
them (``conversion/llama.py`` ``ApertusModel``: Llama's keys and tensor names, the q/k rows as
the checkpoint has them, its llama3 scaling as ``rope_freqs`` factors) and its
``src/models/apertus.cpp`` reads them: per-head ``attn_q_norm`` / ``attn_k_norm`` before the
rotation, NeoX rotary pairs (transformers' half-offset ones), ``ffn_up`` then xIELU then
``ffn_down``.

The converter takes each layer's xIELU scalars out of the tensors (``mlp.act_fn.alpha_p``,
``alpha_n``, ``beta``, ``eps``) into metadata: ``xielu.alpha_p``, ``xielu.alpha_n``,
``xielu.beta``, ``xielu.eps``, without the architecture's prefix, each an array of one float32
a layer, the checkpoint's values as they are (``alpha_p`` / ``alpha_n`` before their softplus,
which ``ggml_xielu`` applies). llama.cpp requires all four and reads each as an array of one
value a layer or as one value for every layer (``get_key_or_arr``); so does FreeToken, which
puts them back as the tensors transformers' model holds (:func:`hf_weights`)."""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_apertus import XIELU_PARAMETERS
from freetoken_core.models.gguf_reader import array_field, require


def xielu_values(reader: Any, layers: int) -> dict[str, list[float]]:
    """Each xIELU scalar's ``layers`` values (``xielu.{name}``: an array of one a layer, or
    one value for all); a missing key, a count other than ``layers`` or a value that is not
    finite is an error naming the key."""
    out: dict[str, list[float]] = {}
    for name in XIELU_PARAMETERS:
        key = f"xielu.{name}"
        values = array_field(reader, key)
        if values is None:
            values = [require(reader, key)] * layers
        if len(values) != layers:
            raise ModelLoadError(f"GGUF {key} has {len(values)} values for {layers} layers; "
                                 "re-export the model with llama.cpp")
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"GGUF {key} holds {values[0]!r}, not numbers") from exc
        if not all(math.isfinite(v) for v in values):
            raise ModelLoadError(f"GGUF {key} holds a value that is not finite; re-export "
                                 "the model")
        out[name] = values
    return out


def apertus_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config keys of an ``apertus`` file beyond the common ones in
    ``config``: xIELU (its metadata checked here, :func:`xielu_values`) and the rope the
    file computes: the ``rope_scaling`` the common code reads (its ``rope_freqs`` factors,
    ``rope.scaling.*``) where it has one, else plain rope of ``rope.freq_base``, not the
    llama3 scaling that ``ApertusConfig`` gives a config without one."""
    xielu_values(reader, config["num_hidden_layers"])
    return {"hidden_act": "xielu", "model_type": "apertus",
            "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"]}}


def hf_weights(reader: Any, weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """``weights`` with each layer's xIELU scalars as the float32 tensors of transformers'
    model: ``alpha_p`` and ``alpha_n`` of shape ``[1]``, ``beta`` and ``eps`` of ``[]``."""
    import torch  # (not at import: the HTTP process reads GGUF metadata without torch)

    values = xielu_values(reader, layers)
    for name, per_layer in values.items():
        for i, value in enumerate(per_layer):
            tensor = torch.tensor(value, dtype=torch.float32)
            weights[f"model.layers.{i}.mlp.act_fn.{name}"] = (
                tensor.reshape(1) if name.startswith("alpha") else tensor)
    return weights
