"""Shared fixtures: tiny random-weight models built locally, engines over them, and the device
the Triton kernel tests run on."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kernel_checks import KERNEL_DEVICE, check_every_launch  # imports torch, not triton

# Triton kernels run on the CPU only through its interpreter, which must be chosen before
# triton is first imported. Where torch sees CUDA the kernels run compiled, on CUDA tensors.
if KERNEL_DEVICE.type != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for ``kernel_device`` runs a Triton kernel or a CUDA path: mark it
    ``gpu``, so ``pytest -m gpu`` on a CUDA machine selects every one of them."""
    for item in items:
        if "kernel_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch single-threaded for a module (``pytestmark = usefixtures(...)``): tiny matmuls
    are ~10x faster on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The device for a Triton kernel test's tensors and processors: CUDA where torch sees
    it, else the CPU (kernels under the interpreter). Every launch in the test is checked
    (``kernel_checks.check_every_launch``)."""
    pytest.importorskip("triton")
    if KERNEL_DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("without CUDA, Triton kernels run only with TRITON_INTERPRET=1")
    check_every_launch(monkeypatch, KERNEL_DEVICE)
    return KERNEL_DEVICE


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the native CPU kernels (first run on a machine: ~80 s on two cores) before any
    test starts
    a server process, which would otherwise spend its start-up timeout on the build."""
    from freetoken_core.kernels import cpu_kernels_available

    cpu_kernels_available()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with GQA, 2,048 positions, and the test tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def plain_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One ``freetoken serve`` of the tiny model with no extra flags, shared by the modules
    whose tests need nothing else and leave nothing behind (a server start costs ~13 s).
    A module whose tests stop the server, count its aborts or watch its start keeps its
    own. Its output goes to a file: a pipe nobody reads would fill and stall it."""
    from server_fixtures import start_server, stop_server

    srv = start_server(tiny_model_dir,
                       log_file=tmp_path_factory.mktemp("plain-server") / "serve.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path):
    from freetoken_core import LLM

    return LLM(str(tiny_model_dir), kv_cache_tokens=65536, max_num_seqs=64, progress=False)
