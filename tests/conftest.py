"""Shared fixtures: tiny random-weight models built locally, and engines over them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton kernels run on the CPU only through its interpreter, which must be chosen before
# triton is first imported. On a CUDA machine the kernels run for real.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the native CPU kernels (first run on a machine: ~15 s) before any test starts
    a server process, which would otherwise spend its start-up timeout on the build."""
    from freetoken_core.kernels import cpu_kernels_available

    cpu_kernels_available()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with GQA, 2,048 positions, and the test tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path):
    from freetoken_core import LLM

    return LLM(str(tiny_model_dir), kv_cache_tokens=65536, max_num_seqs=64, progress=False)
