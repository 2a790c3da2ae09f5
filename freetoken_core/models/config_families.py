"""The families' tables ``config.ModelConfig.from_dict`` reads each family's config.json with:
the MLP activation each checks, the config-class defaults applied first, the fields beyond
the common ones (from the families' config modules)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from freetoken_core.models.cohere_config import cohere_config
from freetoken_core.models.config_apertus import apertus_config
from freetoken_core.models.config_deepseek import mla_config, mla_fields
from freetoken_core.models.config_defaults import (
    ernie4_5_config,
    ernie4_5_moe_config,
    ernie4_5_moe_fields,
    exaone_config,
    hunyuan_dense_config,
    hunyuan_moe_config,
    hunyuan_moe_fields,
    olmoe_config,
    seed_oss_config,
    starcoder2_config,
    with_defaults,
)
from freetoken_core.models.config_falcon_h1 import falcon_h1_config, falcon_h1_fields
from freetoken_core.models.config_fields import (
    exaone4_fields,
    gemma2_fields,
    gemma3_fields,
    glm4_fields,
    ministral3_fields,
    olmo3_fields,
    phi3_fields,
    smollm3_fields,
    starcoder2_fields,
)
from freetoken_core.models.config_gemma3n import gemma3n_config, gemma3n_fields
from freetoken_core.models.config_gemma4 import gemma4_config, gemma4_fields
from freetoken_core.models.config_granite4 import granite4_config, granite4_fields
from freetoken_core.models.config_lfm2 import (
    lfm2_config,
    lfm2_fields,
    lfm2_moe_config,
    lfm2_moe_fields,
)
from freetoken_core.models.config_llama4 import llama4_config, llama4_fields
from freetoken_core.models.config_moe import (
    DOTS1_DEFAULTS,
    GLM4_MOE_DEFAULTS,
    MINIMAX_M2_DEFAULTS,
    dots1_fields,
    glm4_moe_fields,
    gpt_oss_fields,
    minimax_m2_fields,
)
from freetoken_core.models.config_nemotron_h import nemotron_h_config, nemotron_h_fields
from freetoken_core.models.config_phi import phi_config, phi_fields
from freetoken_core.models.config_qwen3_5 import (
    qwen3_5_config,
    qwen3_5_fields,
    qwen3_5_moe_config,
    qwen3_5_moe_fields,
    qwen3_next_config,
    qwen3_next_fields,
)

# The MLP activation of the families that check it (transformers' ACT2FN names).
ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh",
                "gemma4": "gelu_pytorch_tanh", "gemma3n": "gelu_pytorch_tanh",
                "phi3": "silu", "qwen3_5": "silu",
                "qwen3_5_moe": "silu", "qwen3_next": "silu",
                "lfm2": "silu", "lfm2_moe": "silu", "glm4_moe": "silu",
                "granitemoehybrid": "silu", "falcon_h1": "silu",
                "qwen3_moe": "silu", "qwen2_moe": "silu", "mixtral": "silu", "glm4": "silu",
                "olmoe": "silu", "granitemoe": "silu", "hunyuan_dense": "silu",
                "hunyuan_moe": "silu",
                "ministral3": "silu", "olmo2": "silu", "olmo3": "silu", "ernie4_5": "silu", "ernie4_5_moe": "silu",
                "exaone4": "silu", "exaone": "silu", "seed_oss": "silu", "arcee": "relu2",
                "starcoder2": "gelu_pytorch_tanh",
                "cohere": "silu", "cohere2": "silu", "deepseek_v2": "silu",
                "deepseek_v3": "silu", "glm4_moe_lite": "silu",
                "minimax_m2": "silu", "dots1": "silu", "phi": "gelu_new",
                "apertus": "xielu", "llama4": "silu"}

# The families whose config.json is read with their config class's defaults where it leaves
# keys out, under the key names from_dict reads (config_defaults.py, cohere_config.py).
PREPARED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "exaone": exaone_config, "ernie4_5": ernie4_5_config, "seed_oss": seed_oss_config,
    "ernie4_5_moe": ernie4_5_moe_config,
    "starcoder2": starcoder2_config, "olmoe": olmoe_config,
    "hunyuan_dense": hunyuan_dense_config, "gemma4": gemma4_config,
    "gemma3n": gemma3n_config,
    "hunyuan_moe": hunyuan_moe_config,
    "qwen3_5": qwen3_5_config, "qwen3_5_moe": qwen3_5_moe_config,
    "qwen3_next": qwen3_next_config, "lfm2": lfm2_config, "lfm2_moe": lfm2_moe_config,
    "glm4_moe": functools.partial(with_defaults, defaults=GLM4_MOE_DEFAULTS, theta=10_000.0),
    "minimax_m2": functools.partial(with_defaults, defaults=MINIMAX_M2_DEFAULTS,
                                    theta=10_000.0),
    "dots1": functools.partial(with_defaults, defaults=DOTS1_DEFAULTS, theta=10_000.0),
    "granitemoehybrid": granite4_config, "nemotron_h": nemotron_h_config,
    "falcon_h1": falcon_h1_config,
    "cohere": functools.partial(cohere_config, family="cohere"),
    "cohere2": functools.partial(cohere_config, family="cohere2"),
    **{family: functools.partial(mla_config, family=family)
       for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")},
    "phi": phi_config,
    "apertus": apertus_config,
    "llama4": llama4_config,
}

# The families' fields beyond the common ones, read from their config.json alone
# (config_fields.py and the families' own config modules).
FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gemma2": gemma2_fields, "gemma3": gemma3_fields, "gemma4": gemma4_fields,
    "gemma3n": gemma3n_fields,
    "qwen3_5": qwen3_5_fields, "qwen3_5_moe": qwen3_5_moe_fields,
    "qwen3_next": qwen3_next_fields, "lfm2": lfm2_fields, "lfm2_moe": lfm2_moe_fields,
    "glm4_moe": glm4_moe_fields, "smollm3": smollm3_fields, "minimax_m2": minimax_m2_fields,
    "dots1": dots1_fields,
    "granitemoehybrid": granite4_fields, "nemotron_h": nemotron_h_fields,
    "falcon_h1": falcon_h1_fields,
    "ernie4_5_moe": ernie4_5_moe_fields, "hunyuan_moe": hunyuan_moe_fields,
    "ministral3": ministral3_fields, "olmo3": olmo3_fields, "exaone4": exaone4_fields,
    "starcoder2": starcoder2_fields, "phi": phi_fields,
    **{family: functools.partial(mla_fields, family=family)
       for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")},
    "llama4": llama4_fields,
}
# ... and with the rope parameters the common code read.
ROPE_FIELDS = {"phi3": phi3_fields, "gpt_oss": gpt_oss_fields, "glm4": glm4_fields}

# transformers' default activation where config.json leaves hidden_act out, other than SiLU.
DEFAULT_ACTIVATIONS = {"arcee": "relu2", "starcoder2": "gelu_pytorch_tanh", "phi": "gelu_new",
                       "apertus": "xielu"}
