"""``--hf-overrides`` (vLLM's flag; ``LLM(hf_overrides=...)``): config.json keys replaced for
a directory or a GGUF file, e.g. Qwen's documented YaRN setting on a model whose config has
none; a value that is not a JSON object is refused naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gguf_rope_factors import greedy
from test_rope_yarn import TEXTS, YARN
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.errors import InvalidRequest


def test_yarn_by_override_is_the_yarn_config(tmp_path: Path) -> None:
    plain = make_tiny_model(tmp_path / "plain", "qwen2")
    yarn = make_tiny_model(tmp_path / "yarn", "qwen2", rope_scaling=dict(YARN))
    hf = AutoModelForCausalLM.from_pretrained(yarn, dtype=torch.float32).eval()
    llm = LLM(str(plain), kv_cache_tokens=1024, dtype="float32", progress=False,
              plugins="none", hf_overrides={"rope_scaling": dict(YARN)})
    assert llm.engine.core.runner.model.config.rope_scaling["rope_type"] == "yarn"
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == greedy(hf, prompts, 12)


def test_override_of_the_context_length(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(model), kv_cache_tokens=1024, progress=False, plugins="none",
              hf_overrides={"max_position_embeddings": 96})
    assert llm.engine.model_info.max_model_len == 96


def test_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="hf_overrides: must be a JSON object"):
        EngineConfig(hf_overrides=[1, 2])  # type: ignore[arg-type]
    proc = subprocess.run([sys.executable, "-m", "freetoken_core.cli", "serve",
                           "--hf-overrides", "[1]"], check=False, capture_output=True,
                          text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--hf-overrides: expected a JSON object" in proc.stderr
