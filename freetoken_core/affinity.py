"""Which CPUs the serving processes' threads run on (``freetoken serve --pin-threads``).

The engine's main thread runs every step's Python (scheduling, the step's inputs, the
sampler's bookkeeping) between the parallel regions of its kernels, and each step waits
for it. It gets a CPU of its own: ``CpuPlan.main``. Its OpenMP workers, the HTTP process
(every thread: the event loop, the engine reader, the tokenizer pool) and whatever else
runs share the other CPUs (``CpuPlan.shared``). The HTTP work of a token then lands on a
worker's CPU, where it delays one worker's share of a parallel region (which the main
thread's guided scheduling takes over) instead of the main thread's Python, which nothing
else can run. Measured on the 2-core reference (docs/operations.md): unpinned, an engine
step started 0.6 ms after the previous one ended (the HTTP process's reader, woken by the
engine's write, ran on the main thread's CPU first), pinned 0.17 ms; one streaming
client's inter-token latency 0.39 ms lower in the median of 30 paired alternations, no
worse at 16 clients.

Linux only (``os.sched_setaffinity``); with fewer than two CPUs there is nothing to split
and nothing is pinned. A thread inherits the CPUs of the thread that starts it, so a thread
that the engine's main thread starts after pinning would share the main thread's CPU:
``release_thread()`` at its start (or as a thread pool's ``initializer``) moves it to the
shared CPUs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("freetoken.affinity")

_shared: frozenset[int] | None = None
"""The shared CPUs once ``pin_engine_threads`` ran in this process; ``None`` before."""


@dataclass(frozen=True)
class CpuPlan:
    """``main``: the engine main thread's CPU; ``shared``: every other thread's CPUs."""

    main: int
    shared: frozenset[int]


def plan_cpus(cpus: Iterable[int] | None = None) -> CpuPlan | None:
    """The plan for ``cpus`` (default: the CPUs this process may run on): the lowest for the
    engine's main thread, the rest shared. ``None`` where there are fewer than two CPUs or
    the platform cannot pin threads."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    ordered = sorted(os.sched_getaffinity(0) if cpus is None else set(cpus))
    if len(ordered) < 2:
        return None
    return CpuPlan(ordered[0], frozenset(ordered[1:]))


def _thread_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _set(tid: int, cpus: Iterable[int]) -> None:
    try:
        os.sched_setaffinity(tid, set(cpus))
    except ProcessLookupError:
        pass  # the thread ended meanwhile


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process on ``cpus``; threads started later inherit them from
    the thread that starts them (all of them here)."""
    cpus = frozenset(cpus)
    for tid in _thread_ids():
        _set(tid, cpus)


def pin_engine_threads(plan: CpuPlan) -> None:
    """In the engine process, from its main thread: the main thread on ``plan.main``, every
    other thread (OpenMP's workers, started here by a parallel region if not yet) on
    ``plan.shared``. Later ``release_thread()`` calls move their thread to ``plan.shared``."""
    global _shared
    import torch

    # A parallel region now, so that OpenMP's worker threads exist before the main thread
    # narrows its CPUs (threads it starts later would inherit that single CPU).
    torch.zeros(1 << 20).add_(1)
    main = threading.get_native_id()
    for tid in _thread_ids():
        if tid != main:
            _set(tid, plan.shared)
    os.sched_setaffinity(0, {plan.main})
    _shared = plan.shared
    log.info("engine main thread on CPU %d, its other threads on CPUs %s", plan.main,
             ",".join(map(str, sorted(plan.shared))))


def release_thread() -> None:
    """Move the calling thread to the shared CPUs, if this process pinned its threads
    (``pin_engine_threads``); otherwise nothing. For threads started from the engine's main
    thread, e.g. a plugin's worker pool (``ThreadPoolExecutor(initializer=release_thread)``)."""
    if _shared is not None:
        os.sched_setaffinity(0, _shared)
