"""The engine process's heap: large temporaries reuse freed memory instead of new pages.

A decode step allocates and frees the same large tensors every time: the logits
([sequences, vocabulary] float32, 12.6 MB at 64 sequences of a 49,152-token vocabulary) and
the sampler's temporaries of the same size. glibc serves blocks above its mmap threshold
(128 KiB, rising to at most 32 MiB as such blocks are freed) with fresh mmap'd pages and
gives them back on free, and heap memory above the trim threshold goes back to the kernel
too, so each step touched new pages: a page fault and a zeroed page per 4 KiB. At 64
sequences on the 2-core reference that was ~20 ms of a ~270 ms step (the sampler took 26.6 ms
instead of 9.7). Raising the mmap threshold to 64 MiB and the trim threshold to 1 GiB keeps
such blocks in the heap for reuse. Peak memory is unchanged (freed memory is kept, not
added); what the process holds after a peak stays held.

``FREETOKEN_MALLOC_TUNING=0`` leaves the allocator as it is. Only glibc has ``mallopt``;
elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("freetoken.engine")

_ENV = "FREETOKEN_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Apply the thresholds above to this process's glibc allocator; ``True`` if applied."""
    if os.environ.get(_ENV, "1").lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("mallopt refused the heap thresholds; large temporaries fault in new "
                    "pages every step (%s=0 silences this)", _ENV)
    return ok
