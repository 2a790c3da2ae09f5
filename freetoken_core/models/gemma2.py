"""Native Gemma 2 causal LM (transformers' ``Gemma2ForCausalLM``): Gemma 3's model (gemma3.py)
as its config describes Gemma 2, each difference computed as transformers computes it:

- no q/k norms: the projected queries and keys are rotated as they are;
- every score, scaled by ``query_pre_attn_scalar ** -0.5``, softcapped to
  ``cap * tanh(score / cap)`` before the softmax (``attn_logit_softcapping``, 50), on both
  attention paths (``attention.paged_attention``'s ``softcap``);
- the logits softcapped too (``final_logit_softcapping``, 30);
- one rope (``rope_theta``, with ``rope_scaling`` where set) on every layer; every other
  layer, the first included, attends to its last ``sliding_window`` keys (4096).

As Gemma 3's: RMSNorm ``x * (1 + w)`` in float32 before and after attention and the MLP,
embeddings times ``sqrt(hidden_size)``, a GELU-tanh gated MLP, tied embeddings.
"""

from __future__ import annotations

from freetoken_core.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2's model: ``forward`` gives hidden states, ``compute_logits`` float32 logits
    (softcapped), as ``Gemma3ForCausalLM``'s, whose blocks read the differences from the
    config (``qk_norm`` false, ``attn_logit_softcap``, ``rope_local_theta`` None)."""
