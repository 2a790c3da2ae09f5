"""Vision-language directories served for text (models/multimodal.py): the language model
inside a tiny random Qwen2.5-VL, Qwen3-VL, Gemma 3 and Mistral 3 (a Mistral and a Ministral 3
text model) saved by transformers, against transformers' vision-language model on the same
text: greedy tokens, and every position's logits. The vision tower's and projector's
weights are not read. And llama.cpp's files of these language models (qwen2vl, qwen3vl,
qwen3vlmoe), which compute as their text architecture's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf_models import write_gguf
from gguf_writing import finish
from test_arch_gemma3 import chunked_logits
from test_arch_moe import PROMPTS, matching_logits
from test_arch_phi3 import random_model, save_model
from test_gguf_rope_factors import greedy, served
from tiny_models import build_tokenizer

from freetoken_core.errors import ModelLoadError
from freetoken_core.models import loader
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.multimodal import text_config, text_weight_name

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2}
SIGLIP = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 32,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
QWEN3_VL_TEXT = {"head_dim": 16, "rope_parameters": {
    "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
    "rope_theta": 10000.0}}
QWEN3_VL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
                   "out_hidden_size": 64, "deepstack_visual_indexes": [0]}
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # wrapper config class, model class, text_config, vision_config, other keys
    "qwen2.5-vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                        "rope_theta": 10000.0}},
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
                    "out_hidden_size": 64}, {}),
    "qwen3-vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN3_VL_TEXT,
                 QWEN3_VL_VISION, {}),
    "qwen3-vl-moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     {**QWEN3_VL_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 24}, QWEN3_VL_VISION, {}),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration",
               {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"]},
               SIGLIP, {"mm_tokens_per_image": 4}),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                 {"model_type": "mistral", "head_dim": 16, "sliding_window": None},
                 {**SIGLIP, "head_dim": 16}, {"tie_word_embeddings": False}),
    "ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                   {"model_type": "ministral3", "head_dim": 16, "rope_parameters": {
                       "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 32.0,
                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "llama_4_scaling_beta": 0.1}},
                   {**SIGLIP, "head_dim": 16}, {"tie_word_embeddings": False}),
}
# What each wrapper holds beside its language model, which FreeToken does not read.
VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "multi_modal_projector.")


def save_vlm(out_dir: Path, case: str, seed: int = 0) -> Path:
    """A tiny random ``case`` directory saved by transformers, with tests/tiny_models.py's
    tokenizer and O(1)-scale weights (greedy logits well separated)."""
    config_name, model_name, text, vision, extra = CASES[case]
    tok = build_tokenizer(out_dir)
    config = getattr(transformers, config_name)(
        text_config={**TEXT, "vocab_size": len(tok), **text}, vision_config=vision, **extra)
    return save_model(random_model(getattr(transformers, model_name), config, seed), out_dir)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_language_model_of_a_vision_language_directory(tmp_path: Path, case: str) -> None:
    model_dir = save_vlm(tmp_path / case, case)
    hf = getattr(transformers, CASES[case][1]).from_pretrained(
        model_dir, dtype=torch.float32).eval()
    llm, prompts, got = served(model_dir, PROMPTS, 16)
    assert llm.engine.core.runner.model.config.text_of == CASES[case][1]
    assert got == greedy(hf, prompts, 16)
    matching_logits(llm, prompts[-1], hf)


def test_only_the_language_model_is_read(tmp_path: Path) -> None:
    model_dir = save_vlm(tmp_path / "qwen3-vl", "qwen3-vl")
    every = loader.read_weights(model_dir, torch.float32, torch.device("cpu"))
    assert any(name.startswith(VISION_PREFIXES) for name in every)
    read = loader.read_weights(model_dir, torch.float32, torch.device("cpu"), text_weight_name)
    assert not any(name.startswith(VISION_PREFIXES) for name in read)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.self_attn.q_norm.weight"} <= set(read)
    assert all(name.startswith(("model.embed_tokens.", "model.norm.", "model.layers.",
                                "lm_head.")) for name in read)


def test_the_first_qwen2_vl_configs_and_their_mrope_name() -> None:
    """Qwen2-VL's first configs: the language model's keys at the top, rope_scaling of type
    "mrope" (transformers reads it as default frequencies in sections)."""
    flat = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            **TEXT, "vocab_size": 100, "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 1}}
    assert text_config(flat)["architectures"] == ["Qwen2ForCausalLM"]
    cfg = ModelConfig.from_dict(flat)
    assert (cfg.architecture, cfg.rope_scaling, cfg.tie_word_embeddings) == ("qwen2", None, True)
    assert cfg.attention_bias and cfg.text_of == "Qwen2VLForConditionalGeneration"
    # pre-v5 saves: tie_word_embeddings in text_config, forwarded (transformers' Qwen2-VL)
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
              "tie_word_embeddings": False,
              "text_config": {**TEXT, "vocab_size": 100, "tie_word_embeddings": True}}
    assert ModelConfig.from_dict(nested).tie_word_embeddings


def test_hf_overrides_reach_the_language_model(tmp_path: Path) -> None:
    """--hf-overrides of a vision-language directory: the language model's keys into its
    text_config (where transformers reads them), the wrapper's own at the top."""
    model_dir = save_vlm(tmp_path / "qwen3-vl", "qwen3-vl")
    cfg = ModelConfig.from_dir(model_dir, {"max_position_embeddings": 512,
                                           "tie_word_embeddings": True})
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings) == (512, True)
    assert ModelConfig.from_dir(model_dir).max_position_embeddings == 2048


def test_an_unknown_language_model_is_refused_naming_it() -> None:
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"],
           "text_config": {**TEXT, "vocab_size": 100, "model_type": "mixtral"}}
    with pytest.raises(ModelLoadError, match="text_config.model_type 'mixtral'"):
        ModelConfig.from_dict(cfg)
    llava = {"architectures": ["LlavaForConditionalGeneration"], "text_config": TEXT}
    with pytest.raises(ModelLoadError, match=r"'LlavaForConditionalGeneration'\]; FreeToken "
                       r"runs .*, and the language model of Gemma3ForConditionalGeneration, "):
        ModelConfig.from_dict(llava)


@pytest.mark.parametrize(("file_arch", "arch", "experts"), [
    ("qwen2vl", "qwen2", 0), ("qwen3vl", "qwen3", 0), ("qwen3vlmoe", "qwen3moe", 4)])
def test_vision_language_gguf_files_serve_their_language_model(
        tmp_path: Path, file_arch: str, arch: str, experts: int) -> None:
    """A qwen2vl / qwen3vl / qwen3vlmoe file (the language model; llama.cpp keeps the vision
    tower in a separate mmproj file) computes what the same tensors in a qwen2 / qwen3 /
    qwen3moe file compute (test_gguf_archs.py holds those to transformers): the same logits
    at every position, the same greedy tokens."""
    shape = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": experts,
             "ff": 96, "expert_ff": 32, "tied": False, "seed": 5}
    plain = write_gguf(tmp_path / "plain.gguf", arch, **shape)
    vision = write_gguf(tmp_path / "vl.gguf", arch, file_arch=file_arch, **shape, metadata={
        "rope.dimension_sections": [2, 3, 3, 0], "n_deepstack_layers": 1})
    llm, prompts, want = served(plain, PROMPTS, 16)
    vl, _, got = served(vision, PROMPTS, 16)
    assert got == want
    logits = [chunked_logits(engine.engine.core.runner.model, prompts[-1], [len(prompts[-1])])
              for engine in (llm, vl)]
    assert torch.equal(*logits)


def test_sections_that_leave_rotated_dimensions_out_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "vl.gguf", "qwen3", file_arch="qwen3vl", head_dim=16,
                      metadata={"rope.dimension_sections": [2, 2, 2, 2]})
    with pytest.raises(ModelLoadError, match=r"qwen3vl.rope.dimension_sections \[2, 2, 2, 2\]"):
        served(path, PROMPTS, 1)


def test_qwen3_vl_moe_experts_as_released(tmp_path: Path) -> None:
    """Qwen3-VL-MoE's checkpoints hold the fused experts transposed (``gate_up_proj``
    ``[experts, hidden, 2 x size]``, ``down_proj`` ``[experts, size, hidden]``), which
    transformers transposes on load: served as the same model."""
    from safetensors.torch import load_file, save_file

    model_dir = save_vlm(tmp_path / "moe", "qwen3-vl-moe")
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    tensors = load_file(model_dir / "model.safetensors")
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4
    for key in fused:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    _, prompts, got = served(model_dir, PROMPTS, 16)
    assert got == greedy(hf, prompts, 16)


def test_an_mmproj_file_is_named_as_such(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "mmproj-model-f16.gguf"
    writer = GGUFWriter(str(path), "clip")
    writer.add_tensor("v.patch_embd.weight", torch.zeros(4, 4).numpy())
    finish(writer)
    with pytest.raises(ModelLoadError, match="multimodal projector.*mmproj.*main GGUF file"):
        served(path, PROMPTS, 1)
