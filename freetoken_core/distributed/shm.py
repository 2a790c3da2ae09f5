"""Collectives between the ranks of one node through shared memory, without sockets.

``comm`` uses this channel for CPU tensors when every rank runs on one node: a gloo
all-reduce over loopback costs several times as much (figures in ``comm``'s docstring),
and a decode step makes two per layer.

The segment is one file in /dev/shm that rank 0 creates and every rank maps. Rank 0
unlinks it as soon as every rank has mapped it, so nothing is left behind whichever
process dies afterwards: the memory goes with the last mapping.

    header    one 64-byte line per rank (its seq, pid, start time, closed flag and pid
              namespace: a line each, so that a rank's stores do not disturb the lines the
              others spin on), then one line with the broadcast message's length for each
              parity
    slots     2 parities x world_size slots of ``slot_bytes``: the ranks' tensors
    messages  2 parities x ``message_bytes``: broadcast_bytes' message

Protocol. Every rank numbers its collectives 1, 2, ... (all ranks call the same ones in the
same order, so the numbers agree). ``seq[r] = k`` says: rank r has finished every
collective before k and written its part of collective k. Collective k uses the buffers
of parity ``k % 2``, last used by collective k - 2: a rank writes them only once every
rank's seq is at least k - 1 (done with k - 2), then publishes k; a reader reads them once
the writers' seq are at least k. A fast rank thus never overwrites what a slow one is
still reading, and runs at most one collective ahead.

Memory order: a writer stores its data, then its seq; a reader loads the seq, then the
data. x86-64 keeps stores in order with stores and loads with loads (TSO) and an aligned
8-byte store is atomic, so plain numpy and torch stores and loads suffice; a weaker
architecture (ARM) would need fences, so the channel runs on x86-64 only
(``is_supported``).

Waiting spins on the counters, then yields the CPU between looks (on two cores the ranks
may share one), then after ``BUSY_WAIT_S`` sleeps ``SLEEP_S`` between looks, so that a
worker idle in broadcast_bytes costs no core. Every ``LIVENESS_S`` a waiter checks that the
ranks it waits for are still running (their pid and start time in /proc: a pid alone could
be a zombie or a new process); a dead or closed peer, or a wait past its timeout, raises
``CommunicationError``.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from freetoken_core.errors import CommunicationError

log = logging.getLogger("freetoken.distributed")

BUSY_WAIT_S = 0.002
"""How long a wait spins and yields before it sleeps between looks."""
SLEEP_S = 0.001
LIVENESS_S = 0.1
"""How often a wait checks that the ranks it waits for are alive."""

_SPINS = 100
"""Looks at the counters before a wait reads the clock or yields (tens of microseconds)."""
_LINE = 64
_SEQ, _PID, _START, _CLOSED, _PID_NAMESPACE = range(5)
"""The int64 words of a rank's header line."""


def is_supported() -> bool:
    """Whether this machine can run the channel: Linux (/dev/shm, /proc) on x86-64 (TSO)."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


def _segment_bytes(world_size: int, slot_bytes: int, message_bytes: int) -> int:
    return _header_bytes(world_size) + 2 * world_size * slot_bytes + 2 * message_bytes


def _header_bytes(world_size: int) -> int:
    return -(-(world_size + 1) * _LINE // mmap.PAGESIZE) * mmap.PAGESIZE


def _start_time(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks after boot); ``None`` once it has exited,
    zombies included (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


class ShmChannel:
    """One rank's view of the segment. Tensors given to ``all_reduce`` and
    ``gather_to_first`` must pass ``fits``; messages longer than ``message_bytes`` do not go
    through the segment (``send_message`` says so to the receivers)."""

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, slot_bytes: int,
                 message_bytes: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._mm = mm
        self._slot_bytes = slot_bytes
        self._message_bytes = message_bytes
        self._timeout_s = timeout_s
        header = _header_bytes(world_size)
        self._lines = np.frombuffer(mm, np.int64, count=header // 8).reshape(-1, _LINE // 8)
        self._seq = self._lines[:world_size, _SEQ]
        self._slots = [
            [torch.frombuffer(mm, dtype=torch.uint8, count=slot_bytes,
                              offset=header + (parity * world_size + r) * slot_bytes)
             for r in range(world_size)] if slot_bytes else []
            for parity in range(2)
        ]
        self._views_key: tuple[torch.Size, torch.dtype] | None = None
        self._views: list[list[torch.Tensor]] = []
        """Both parities' slots viewed as ``_views_key`` (the step's shape, most calls)."""
        self._message_offset = header + 2 * world_size * slot_bytes
        self._others = [r for r in range(world_size) if r != rank]
        self._ops = 0
        self._settled = 0
        """Every other rank's seq is known to be at least this."""

    def announce(self) -> None:
        """Write this process's pid, start time and pid namespace into its line, for the
        others' checks."""
        line = self._lines[self.rank]
        line[_PID] = os.getpid()
        line[_START] = _start_time(os.getpid())
        line[_PID_NAMESPACE] = _pid_namespace()

    def check_peers(self) -> None:
        """Raise unless every rank's pid means the same process here as there."""
        for r in self._others:
            if self._lines[r, _PID_NAMESPACE] != _pid_namespace():
                raise CommunicationError(
                    f"rank {self.rank}: rank {r} runs in another pid namespace (another "
                    "container?): its liveness cannot be checked; use same_node=False")

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_cpu and t.nbytes <= self._slot_bytes

    def all_reduce(self, t: torch.Tensor) -> None:
        slots = self._write_slot(t, "all_reduce")
        self._wait_for(self._others, self._ops, self._timeout_s, "all_reduce")
        if self.world_size > 1:
            torch.add(slots[0], slots[1], out=t)
        for slot in slots[2:]:
            t.add_(slot)

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        slots = self._write_slot(t, "gather_to_first")
        if self.rank != 0:
            return None
        self._wait_for(self._others, self._ops, self._timeout_s, "gather_to_first")
        return [slot.clone() for slot in slots]

    def send_message(self, data: bytes) -> bool:
        """Rank 0: publish ``data`` to the receivers; ``False`` where it is too long for the
        segment, and only that news went (the caller sends the bytes another way)."""
        k = self._begin("broadcast_bytes")
        fits = len(data) <= self._message_bytes
        if fits:
            start = self._message_offset + (k % 2) * self._message_bytes
            self._mm[start : start + len(data)] = data
        self._lines[self.world_size, k % 2] = len(data) if fits else -1
        self._publish(k)
        return fits

    def receive_message(self) -> bytes | None:
        """Another rank: rank 0's message; ``None`` where it comes another way. Waits while
        rank 0 lives, however long."""
        self._ops += 1
        k = self._ops
        self._publish(k)
        self._wait_for([0], k, None, "broadcast_bytes")
        length = int(self._lines[self.world_size, k % 2])
        if length < 0:
            return None
        start = self._message_offset + (k % 2) * self._message_bytes
        return self._mm[start : start + length]

    def close(self) -> None:
        """Tell the others this rank is gone, and unmap the segment once no view holds it."""
        self._lines[self.rank, _CLOSED] = 1
        self._lines = self._seq = self._slots = self._views = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it

    def _write_slot(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Start collective k: this rank's slot of parity k holds ``t``, seq says so. The
        slots, viewed with ``t``'s shape and dtype."""
        k = self._begin(what)
        if self._views_key != (t.shape, t.dtype):
            self._views_key = (t.shape, t.dtype)
            with torch.inference_mode(False):  # views made in it could not be written outside
                self._views = [[s[: t.nbytes].view(t.dtype).view(t.shape) for s in parity]
                               for parity in self._slots]
        slots = self._views[k % 2]
        slots[self.rank].copy_(t)
        self._publish(k)
        return slots

    def _begin(self, what: str) -> int:
        """Number the next collective; return once its buffers are free to write."""
        self._ops += 1
        if self._settled < self._ops - 1:
            self._wait_for(self._others, self._ops - 1, self._timeout_s, what)
        return self._ops

    def _publish(self, k: int) -> None:
        self._seq[self.rank] = k

    def _wait_for(self, ranks: Sequence[int], k: int, timeout_s: float | None,
                  what: str) -> None:
        """Return once every rank in ``ranks`` has published ``k``; raise
        ``CommunicationError`` when one of them dies or closes, or after ``timeout_s``."""
        seq = self._seq
        spins = 0
        start = next_check = 0.0
        while not all(seq[r] >= k for r in ranks):
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if spins == _SPINS:
                start, next_check = now, now + LIVENESS_S
            elif now >= next_check:
                next_check = now + LIVENESS_S
                laggards = [r for r in ranks if seq[r] < k]
                self._check_alive(laggards, what)
                if timeout_s is not None and now - start > timeout_s:
                    raise CommunicationError(
                        f"rank {self.rank}: rank(s) {laggards} did not reach {what} "
                        f"(collective #{k}) within {timeout_s:g} s")
            if now - start < BUSY_WAIT_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
        if len(ranks) == len(self._others):
            self._settled = max(self._settled, k)

    def _check_alive(self, ranks: Sequence[int], what: str) -> None:
        for r in ranks:
            pid, started, closed = (int(self._lines[r, i]) for i in (_PID, _START, _CLOSED))
            if closed:
                raise CommunicationError(
                    f"rank {self.rank}: rank {r} closed its communicator during {what}")
            if _start_time(pid) != started:
                raise CommunicationError(
                    f"rank {self.rank}: rank {r} (pid {pid}) died during {what}")


def open_channel(path: str, rank: int, world_size: int, barrier: Callable[[], None], *,
                 slot_bytes: int, message_bytes: int, timeout_s: float) -> ShmChannel:
    """Every rank calls this together: rank 0 creates the segment at ``path`` (a file in
    /dev/shm), with slots of ``slot_bytes`` or smaller where the free space is short (the
    others learn the size from the file's), the others map it after ``barrier()``, and
    rank 0 unlinks it after the next one, or when any of this fails."""
    if rank == 0:
        slot_bytes = _fitting_slot_bytes(os.path.dirname(path), world_size, slot_bytes,
                                         message_bytes)
        _create(path, _segment_bytes(world_size, slot_bytes, message_bytes))
    try:
        barrier()
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            slot_bytes = (size - _segment_bytes(world_size, 0, message_bytes)) // (2 * world_size)
            channel = ShmChannel(mmap.mmap(fd, size), rank, world_size, slot_bytes,
                                 message_bytes, timeout_s)
        finally:
            os.close(fd)
        channel.announce()
        barrier()
    finally:
        if rank == 0:
            os.unlink(path)
    channel.check_peers()
    return channel


def _fitting_slot_bytes(directory: str, world_size: int, slot_bytes: int,
                        message_bytes: int) -> int:
    """``slot_bytes``, or the most that leaves half of ``directory``'s free space to others (a
    container's /dev/shm is 64 MiB unless told otherwise: docker's --shm-size); larger
    tensors then go over gloo. Raises where not even the message buffers fit."""
    stat = os.statvfs(directory)
    room = stat.f_bavail * stat.f_frsize // 2
    fixed = _segment_bytes(world_size, 0, message_bytes)
    if room < fixed:
        raise CommunicationError(
            f"rank 0: {directory} has {2 * room} bytes free; the shared-memory channel needs "
            f"twice {fixed}: enlarge it (docker: --shm-size) or use same_node=False")
    fitting = min(slot_bytes, (room - fixed) // (2 * world_size) // _LINE * _LINE)
    if fitting < slot_bytes:
        log.warning("%s has %d MiB free: tensors above %d KiB go over gloo instead of shared "
                    "memory (enlarge it: docker's --shm-size)", directory, 2 * room >> 20,
                    fitting >> 10)
    return fitting


def _create(path: str, size: int) -> None:
    """A fresh zero-filled file of ``size`` bytes at ``path`` (pages are allocated as they
    are first written), replacing one a crashed group left."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
