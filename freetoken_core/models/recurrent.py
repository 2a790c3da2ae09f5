"""What the models with recurrent layers share (Qwen3.5's Gated DeltaNet, ``gated_deltanet``;
LFM2's short convolutions, ``short_conv``; the Mamba-2 mixers of Granite 4, Nemotron-H and
Falcon-H1, ``mamba2``): :class:`RecurrentModel`, and a state per running sequence in each
such layer, kept in the sequence's scheduler slot (``Sequence.slot``, one of
``max_num_seqs``), all of them allocated at start and zeroed where a sequence's first token
is in the step (``attention.SequenceSpans.fresh``)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from freetoken_core import hugepages
from freetoken_core.errors import ModelLoadError


class Mixer(Protocol):
    """A recurrent layer's token mixer: the size of a sequence's state, and the states of
    ``slots`` sequences."""

    def state_bytes(self, dtype: torch.dtype) -> int: ...

    def states(self, slots: int, dtype: torch.dtype, device: torch.device) -> Any: ...


def check_step(model: Any, meta: Any) -> None:
    """A step of a model with recurrent layers needs its sequences' slots
    (``AttentionMetadata.sequences``, which the engine's runner gives) and the states
    allocated (``allocate_states``)."""
    if meta.sequences is None or not model.states:
        raise RuntimeError(f"{model.config.architecture} steps need their sequences' state "
                           "slots (AttentionMetadata.sequences) and allocate_states first")


def allocate_states(mixers: list[Mixer | None], slots: int, dtype: torch.dtype,
                    device: torch.device) -> list[Any]:
    """Each layer's states for ``slots`` sequences (None for a layer without: attention);
    refused, naming ``--max-num-seqs``, where the memory available cannot hold them."""
    per_slot = sum(m.state_bytes(dtype) for m in mixers if m is not None)
    available = hugepages.available_bytes() if device.type == "cpu" else None
    if available is not None and slots * per_slot > available:
        raise ModelLoadError(
            f"the recurrent states of {slots} sequences take {slots * per_slot / 2**30:.1f} "
            f"GiB ({per_slot / 2**20:.1f} MiB a sequence), more than the "
            f"{available / 2**30:.1f} GiB of memory available; lower --max-num-seqs (about "
            f"{max(available // per_slot // 2, 1)} fit)")
    return [None if m is None else m.states(slots, dtype, device) for m in mixers]


class RecurrentModel:
    """What a model with recurrent layers adds to Llama's (a base before
    ``LlamaForCausalLM``): ``recurrent`` (the engine's runner gives each running sequence a
    slot and calls :meth:`allocate_states`), the states of the layers' mixers (each layer's
    ``mixer_name`` attribute; absent or None on an attention layer), and the refusal of
    tensor parallelism (:meth:`refuse_shard`: a rank would hold part of every state)."""

    recurrent = True
    family = "this model"
    """The family's name in the refusal of tensor parallelism."""
    mixers = "recurrent layers"
    """What the family's recurrent layers are called there."""
    mixer_name = "mixer"
    """The layers' attribute that holds their recurrent mixer."""
    layers: list[Any]
    embedding: Any
    states: list[Any]

    @classmethod
    def refuse_shard(cls, shard: Any) -> None:
        """Refuse tensor parallelism (a ``shard`` given), naming the family."""
        if shard is not None:
            raise ModelLoadError(f"tensor parallelism of {cls.family} is not supported (its "
                                 f"{cls.mixers}); serve it on one rank (data parallelism "
                                 "replicates it)")

    def allocate_states(self, slots: int) -> None:
        """Zeroed states for ``slots`` sequences in every recurrent layer
        (:func:`allocate_states`)."""
        self.states = allocate_states(
            [getattr(layer, self.mixer_name, None) for layer in self.layers], slots,
            self.embedding.dtype, self.embedding.device)


def conv_with_state(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution of one sequence's ``x`` ``[T, channels]`` after its
    ``history`` ``[channels, kernel - 1]`` (its previous inputs; zeros before its first
    token), as transformers' ``causal_conv1d_fn`` computes it (``F.conv1d`` in the
    weight's dtype): the outputs ``[T, channels]`` and the new history."""
    joined = torch.cat([history, x.t().to(history.dtype)], dim=-1)
    out = torch.nn.functional.conv1d(joined[None].to(weight.dtype), weight, bias,
                                     groups=weight.shape[0])[0]
    return out.t(), joined[:, joined.shape[1] - history.shape[1]:]


def conv_step(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of a batch of sequences: ``x`` ``[B, channels]`` after their
    ``history`` ``[B, channels, kernel - 1]`` (transformers' ``causal_conv1d_update``): the
    outputs ``[B, channels]`` and the new histories."""
    joined = torch.cat([history, x[..., None].to(history.dtype)], dim=-1)
    out = torch.nn.functional.conv1d(joined.to(weight.dtype), weight, bias,
                                     groups=weight.shape[0])[..., -1]
    return out, joined[..., 1:]
