"""The structured-outputs plugin's tests (test_plugin_structured_outputs.py) again, on a
tensor-parallel engine: its ``llm``, ``server`` and ``default_llm`` split their model over
two ranks; the grammar masks rank 0's gathered logits and must behave as on one rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import Server, start_server, stop_server
from test_plugin_structured_outputs import *  # its tests and fixtures, collected here

from freetoken_core import LLM


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, backend: str) -> Iterator[LLM]:
    with LLM(str(tiny_model_dir), kv_cache_tokens=8192, max_num_seqs=16, progress=False,
             plugin_options={"structured_outputs_backend": backend},
             tensor_parallel_size=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def default_llm(backend: str) -> Iterator[LLM]:
    with LLM(None, kv_cache_tokens=8192, max_num_seqs=8, progress=False,
             plugin_options={"structured_outputs_backend": backend},
             tensor_parallel_size=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, backend: str) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--structured-outputs-backend", backend,
                       "--tensor-parallel-size", "2")
    yield srv
    stop_server(srv)
