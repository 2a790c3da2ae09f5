"""freetoken_core.hugepages: zero tensors in memory advised for transparent huge pages."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from freetoken_core import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            start, end = (int(x, 16) for x in span.groups())
            current = start <= address < end
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def _resident_kib(t: torch.Tensor) -> int:
    """KiB of the tensor's pages that are resident (mincore over its bytes; not smaps, whose
    mapping the kernel may have merged with a neighbour)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() // hugepages.PAGE * hugepages.PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // hugepages.PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * hugepages.PAGE // 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zeros_is_a_writable_zero_tensor_of_the_shape(dtype: torch.dtype) -> None:
    shape = (3, 1 << 19, 2)  # 3 MiB and more: one huge page at least
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 7, 1] = 5
    assert t.sum().item() == 5
    if hugepages.enabled():
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0


def test_small_tensors_and_the_switch_give_plain_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hugepages.zeros((16, 16), torch.float32)
    assert small.shape == (16, 16) and not small.any()
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    big = hugepages.zeros((1 << 20,), torch.float32)
    assert big.shape == (1 << 20,) and not big.any()


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mincore"), reason="no mincore")
def test_with_huge_pages_off_the_memory_still_comes_as_it_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``FREETOKEN_HUGE_PAGES=0`` keeps the lazy mapping (4 KiB pages): a model's re-layout
    writes its new arena while it gives the old one back, so the two are never resident
    together (torch.zeros' were: a 19.5 GB file's load was OOM-killed)."""
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "0")
    lazy = hugepages.zeros((16 << 20,), torch.uint8)
    assert _resident_kib(lazy) < 1024
    lazy[: 4 << 20] = 1
    assert 4096 <= _resident_kib(lazy) < 5120


needs_mappings = pytest.mark.skipif(
    not hugepages.enabled() or not hasattr(ctypes.CDLL(None), "mincore"),
    reason="huge-page mappings off, or no mincore")


@needs_mappings
def test_populate_writes_every_page_before_the_tensor_is_used() -> None:
    size = 16 << 20  # 16 MiB
    lazy = hugepages.zeros((size,), torch.uint8)
    assert _resident_kib(lazy) < 4096  # nothing touched: (almost) nothing resident
    populated = hugepages.zeros((size,), torch.uint8, populate=True)
    assert _resident_kib(populated) >= size // 1024
    assert not populated.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this host")
def test_the_kernel_backs_the_tensor_with_huge_pages() -> None:
    t = hugepages.zeros((8 << 20,), torch.uint8)  # 8 MiB
    t.fill_(1)  # first touch: the faults map huge pages
    assert _huge_kib_at(t.data_ptr()) >= 2048


@pytest.mark.skipif(not hugepages.enabled(), reason="huge-page mappings off on this host")
def test_the_model_keeps_its_blocks_and_kv_cache_in_huge_page_memory() -> None:
    from freetoken_core import LLM

    llm = LLM(None, progress=False, kv_cache_tokens=4096)
    runner = llm.engine.core.runner
    model = runner.model
    blocks = [lin.blocks[1] for layer in model.layers for lin in layer.linears]
    blocks.append(model.lm_head.blocks[1])
    # one buffer: every linear's blocks inside the first one's huge-page-aligned arena
    base = min(b.data_ptr() for b in blocks)
    assert base % hugepages.HUGE_PAGE == 0
    assert len({b.untyped_storage().data_ptr() for b in blocks}) == 1
    assert runner.kv_caches.data_ptr() % hugepages.HUGE_PAGE == 0


@needs_mappings
@pytest.mark.parametrize("prefault", [True, False])
def test_the_kv_cache_is_resident_from_the_start_unless_told_otherwise(prefault: bool) -> None:
    """``kv_cache_prefault`` (``--kv-cache-prefault``, the default): the engine writes its
    KV cache once when it starts, so the first requests' decode steps do not fault its
    pages in (the block manager hands out never-used blocks first, so a lazy cache keeps
    faulting until every block was written once); off, the cache stays unwritten."""
    from freetoken_core import LLM

    llm = LLM(None, progress=False, kv_cache_tokens=4096, kv_cache_prefault=prefault,
              plugins="none")
    kv = llm.engine.core.runner.kv_caches
    nbytes = kv.numel() * kv.element_size()
    if prefault:
        assert _resident_kib(kv) >= nbytes // 1024
    else:
        assert _resident_kib(kv) < nbytes // 1024 // 4


def test_the_prefault_flag_reaches_the_engine_config() -> None:
    from freetoken_core.cli import _engine_options, build_parser
    from freetoken_core.config import EngineConfig

    assert EngineConfig().kv_cache_prefault
    assert _engine_options(build_parser().parse_args(["serve"]))["kv_cache_prefault"]
    off = _engine_options(build_parser().parse_args(["serve", "--no-kv-cache-prefault"]))
    assert off["kv_cache_prefault"] is False
    assert EngineConfig(**off).kv_cache_prefault is False


def test_a_kv_cache_the_memory_cannot_hold_is_refused_before_it_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_core import LLM, ModelLoadError

    monkeypatch.setattr(hugepages, "available_bytes", lambda: 64 << 20)  # 64 MiB free
    with pytest.raises(ModelLoadError, match=r"GiB of memory available; lower --kv-cache-tokens"):
        LLM(None, progress=False, kv_cache_tokens=4096, plugins="none")  # 180 MiB of cache
    # Mapped lazily, it is not written at start: nothing to refuse.
    LLM(None, progress=False, kv_cache_tokens=4096, plugins="none", kv_cache_prefault=False)


def test_a_kv_cache_that_does_not_fit_beside_the_weights_is_refused_naming_what_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's weights count: with 100 MiB free beyond the default file, its 180 MiB
    cache of 4,096 tokens is refused, the message naming the weights and the 2,048 tokens
    that fit; those start."""
    from freetoken_core import LLM, ModelLoadError
    from freetoken_core.models.resolve import default_gguf_path

    weights = default_gguf_path().stat().st_size
    monkeypatch.setattr(hugepages, "available_bytes", lambda: weights + (100 << 20))
    with pytest.raises(ModelLoadError, match=r"the model's weights ~0\.1 GiB, more than the "
                                             r"0\.2 GiB .* \(about 2,048 fit\)"):
        LLM(None, progress=False, kv_cache_tokens=4096, plugins="none")
    LLM(None, progress=False, kv_cache_tokens=2048, plugins="none")


def test_the_kv_cache_is_written_on_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KvCache`` writes the cache while the engine loads the rest (the default model's
    start 2.6 -> 1.1-1.6 s on the Zen 5 VM): ``tensor()`` gives it zeroed, of its shape;
    what the thread raised is raised there; a model of another shape is refused."""
    from freetoken_core import LLM
    from freetoken_core.engine.model_runner import KvCache, ModelRunner

    cpu = torch.device("cpu")
    cache = KvCache((2, 4096, 2, 3, 64), torch.float32, cpu)
    kv = cache.tensor()
    assert kv.shape == (2, 4096, 2, 3, 64) and not kv.any()
    assert cache.tensor() is kv

    def fail(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError("no room")

    monkeypatch.setattr(hugepages, "zeros", fail)
    with pytest.raises(MemoryError, match="no room"):
        KvCache((2, 4096, 2, 3, 64), torch.float32, cpu).tensor()
    monkeypatch.undo()
    llm = LLM(None, progress=False, kv_cache_tokens=4096, plugins="none")
    model = llm.engine.core.runner.model
    with pytest.raises(ValueError, match="a KV cache of shape"):
        ModelRunner(model, 8, 8, torch.float32, cpu, kv_cache=cache)


def test_available_bytes_reads_meminfo() -> None:
    available = hugepages.available_bytes()
    if Path("/proc/meminfo").exists():
        assert available is not None and available > 0
