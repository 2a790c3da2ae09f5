"""CPU tensors in transparent huge pages (2 MiB), for the memory every decode step streams.

A decode step of the default model reads all ~96 MB of its weight blocks, and at 16
sequences of ~100 tokens ~70 MB of KV cache spread over their cache blocks. In 4 KiB pages
that is tens of thousands of pages a step, each one a TLB miss and a page walk that the
kernels wait on; in 2 MiB pages it is a few dozen. Measured on the 2-core reference (paired
in one process): the 30 layers' linears at one row 7.68 -> 7.32 ms and the tied head 1.91
-> 1.56 ms with the blocks in huge pages; decode attention over 16 sequences 10.9 -> 9.9 ms
(contexts ~100) and 37.9 -> 35.3 ms (~400) with the KV cache in them. Whole decode steps
moved by ~1 %, inside this VM's noise.

The memory is anonymous and private, aligned to 2 MiB and advised ``MADV_HUGEPAGE`` before
it is first touched, which the kernel backs with huge pages where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (the default of
most distributions), and with 4 KiB pages otherwise: nothing fails either way. Pages are
zero until written and are allocated as they are first touched, unless ``populate`` writes
them all at once (the KV cache, ``--kv-cache-prefault``). ``FREETOKEN_HUGE_PAGES=0`` turns
the advice off (the memory is mapped the same way, in 4 KiB pages); a platform without
``madvise`` gets that too, and one without anonymous mappings, or a tensor below one huge
page of size, plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
_ENV = "FREETOKEN_HUGE_PAGES"


def enabled() -> bool:
    """Whether ``zeros`` maps huge pages here (``FREETOKEN_HUGE_PAGES`` not ``0``, and the
    platform has ``madvise(MADV_HUGEPAGE)``)."""
    return os.environ.get(_ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A contiguous zero CPU tensor of ``shape`` and ``dtype`` in memory advised for huge
    pages (``torch.zeros`` where that is off or the tensor is smaller than one huge page).
    The tensor keeps its mapping alive; the mapping goes when the last view of it does.
    ``populate``: every page written once now (by ATen's threads), so that it is resident
    before the tensor is used; else pages come as they are first touched."""
    import torch

    nbytes = tensor_bytes(shape, dtype)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)  # (written: torch.zeros fills its memory)
    # Mapped, not torch.zeros, with huge pages off too: its pages come as they are written
    # (a model's re-layout writes a new arena while giving the old one's pages back: with
    # torch.zeros both were resident at once, and a 19.5 GB file's load met the OOM killer).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if enabled():
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapping, dtype=np.uint8)  # holds the mapping open
    start = -raw.ctypes.data % HUGE_PAGE
    tensor = torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
    if populate:
        tensor.zero_()
    return tensor


def available_bytes() -> int | None:
    """The memory the system can give without swapping (``MemAvailable`` of /proc/meminfo);
    ``None`` where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def madvise_dontneed(address: int, length: int) -> None:
    """``madvise(address, length, MADV_DONTNEED)`` where libc has it (Linux); else nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # pragma: no cover - not a POSIX libc
        return
    libc.madvise(address, length, _MADV_DONTNEED)


def release(tensor: torch.Tensor) -> None:
    """Give back the pages that lie wholly inside ``tensor``'s bytes (``madvise
    MADV_DONTNEED``; they read as zeros afterwards): for a CPU tensor that nothing reads any
    more but that shares its memory with tensors still in use (a linear's blocks in an arena
    of many linears), whose memory dropping the tensor would not return."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last > first:
        madvise_dontneed(first, last - first)
