"""The logit_bias plugin's tests (test_plugin_logit_bias.py) again, on a tensor-parallel
engine: ``tiny_llm`` splits the tiny model over two ranks; the plugin runs on rank 0 over
the gathered logits and must behave as on one rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_logit_bias import *  # its tests and fixtures, collected here

from freetoken_core import LLM


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_model_dir), kv_cache_tokens=65536, max_num_seqs=64, progress=False,
             tensor_parallel_size=2) as llm:
        yield llm
