"""Which native model class runs a model: by ``ModelConfig.architecture`` (the family
``config.SUPPORTED_ARCHITECTURES`` maps each Hugging Face architecture name to)."""

from __future__ import annotations

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.cohere import CohereForCausalLM
from freetoken_core.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from freetoken_core.models.deepseek import DeepseekForCausalLM
from freetoken_core.models.ernie4_5 import Ernie4_5ForCausalLM
from freetoken_core.models.falcon_h1 import FalconH1ForCausalLM
from freetoken_core.models.gemma2 import Gemma2ForCausalLM
from freetoken_core.models.gemma3 import Gemma3ForCausalLM
from freetoken_core.models.gemma3n import Gemma3nForCausalLM
from freetoken_core.models.gemma4 import Gemma4ForCausalLM
from freetoken_core.models.glm4 import Glm4ForCausalLM
from freetoken_core.models.glm4_moe import Glm4MoeForCausalLM
from freetoken_core.models.granite_hybrid import GraniteHybridForCausalLM
from freetoken_core.models.lfm2 import Lfm2ForCausalLM
from freetoken_core.models.llama import LlamaForCausalLM
from freetoken_core.models.llama4 import Llama4ForCausalLM
from freetoken_core.models.nemotron_h import NemotronHForCausalLM
from freetoken_core.models.olmo2 import Olmo2ForCausalLM
from freetoken_core.models.phi import PhiForCausalLM
from freetoken_core.models.phi3 import Phi3ForCausalLM
from freetoken_core.models.qwen3_5 import Qwen3_5ForCausalLM
from freetoken_core.models.smollm3 import SmolLM3ForCausalLM
from freetoken_core.models.starcoder2 import Starcoder2ForCausalLM

_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5ForCausalLM,  # (experts in every layer: moe.SparseMoE)
    "qwen3_next": Qwen3_5ForCausalLM,  # (Qwen3.5-MoE's layers, its projections fused)
    "lfm2": Lfm2ForCausalLM,
    "granitemoehybrid": GraniteHybridForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,  # (attention and Mamba-2 side by side in every block)
    "lfm2_moe": Lfm2ForCausalLM,  # (experts past the first layers: moe.py's sigmoid gating)
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "gemma3n": Gemma3nForCausalLM,  # (Gemma 4's attention and PLE, AltUp, LAuReL, sparsity)
    "phi3": Phi3ForCausalLM,
    "phi": PhiForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "granite": LlamaForCausalLM,  # (its multipliers are ModelConfig fields Llama's reads)
    "granitemoe": LlamaForCausalLM,  # (Granite's multipliers, experts in every layer)
    "qwen3_moe": LlamaForCausalLM,  # (mixture-of-experts MLPs: moe.py, which Llama's
    "qwen2_moe": LlamaForCausalLM,  # blocks build where the config has experts)
    "mixtral": LlamaForCausalLM,
    "hunyuan_dense": LlamaForCausalLM,  # (q/k norms after the rotation: llama.py)
    "hunyuan_moe": LlamaForCausalLM,  # (Hunyuan dense's layers, experts, a shared MLP)
    "olmoe": LlamaForCausalLM,  # (experts, and q/k norms over all heads: llama.py)
    "gpt_oss": LlamaForCausalLM,  # (sinks, biases and windows: config fields too)
    "glm4": Glm4ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "minimax_m2": Glm4MoeForCausalLM,  # (GLM-4.5's partial rotary; full-width q/k norms)
    "dots1": Glm4MoeForCausalLM,  # (GLM-4.5's experts; Qwen3's attention, whole-head rotary)
    "deepseek_v2": DeepseekForCausalLM,  # (multi-head latent attention, experts)
    "deepseek_v3": DeepseekForCausalLM,
    "glm4_moe_lite": DeepseekForCausalLM,  # (DeepSeek-V3's layers: GLM-4.7-Flash)
    "ministral3": LlamaForCausalLM,  # (its attention temperature: config fields too)
    "olmo2": Olmo2ForCausalLM,
    "olmo3": Olmo2ForCausalLM,  # (OLMo 2's blocks with sliding-window layers)
    "ernie4_5": Ernie4_5ForCausalLM,
    "ernie4_5_moe": Ernie4_5ForCausalLM,  # (with experts: moe.py's biased softmax choice)
    "exaone": LlamaForCausalLM,  # (Llama under other names: weight_names.py)
    "seed_oss": LlamaForCausalLM,  # (Llama with q/k/v biases)
    "arcee": LlamaForCausalLM,  # (Llama with a ReLU² MLP: ModelConfig.gated_mlp)
    "starcoder2": Starcoder2ForCausalLM,
    "exaone4": Olmo2ForCausalLM,  # (OLMo 2's blocks, per-head q/k norms, NoPE global layers)
    "cohere": CohereForCausalLM,
    "cohere2": CohereForCausalLM,  # (Cohere's blocks, sliding layers beside NoPE global ones)
    "apertus": LlamaForCausalLM,  # (q/k norms, an xIELU MLP without a gate: apertus.py)
    "llama4": Llama4ForCausalLM,
}

SUPPORTED: tuple[str, ...] = tuple(sorted(_CLASSES))
"""The families (``ModelConfig.architecture`` values) a native model class runs."""


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The class to build ``cfg``'s model with: ``model_class(cfg)(cfg, weights,
    max_positions)``. Raises ``ModelLoadError`` for a family without one."""
    cls = _CLASSES.get(cfg.architecture)
    if cls is None:
        raise ModelLoadError(
            f"no native model for architecture {cfg.architecture!r}; FreeToken runs "
            f"{', '.join(SUPPORTED)} ({', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    return cls
