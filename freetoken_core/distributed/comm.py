"""How the ranks of a tensor-parallel group talk: ``init_communicator`` and ``Communicator``.

Every rank holds a shard of each layer's weights, computes its partial output and sums
it with the others' (``all_reduce``, twice per layer); rank 0 sends each engine step's
inputs to the others (``broadcast_bytes``) and collects what only it needs
(``gather_to_first``). All ranks must keep bitwise identical hidden states, so a sum is
the same bits everywhere: on the CPU paths it is the sum in rank order, ``((t0 + t1) +
t2) ...``. gloo's own all-reduce is not: with 3 ranks it gives every rank the same
result, but not the rank-order sum, so the gloo path gathers every rank's tensor and
each rank sums them in rank order. NCCL's all-reduce (CUDA) gives every rank the same bits
(each chunk is reduced once, then copied to every rank), summed in NCCL's order.

Underneath is torch.distributed: NCCL for CUDA tensors, gloo for CPU tensors across
nodes and for what does not fit the channel, and a second gloo group with no practical
timeout for ``broadcast_bytes``, where idle workers wait as long as the engine is idle.
On one node (``same_node=True``) the ranks also share a segment of /dev/shm (``shm``):
CPU tensors up to ``shm_slot_bytes`` and messages up to ``MESSAGE_BUFFER_BYTES`` go
through it. An all-reduce of a decode step's [16, 576] float32 hidden states between 2
ranks (one thread each, on the 2-core machine, bench/comm_latency.py) takes a median of
20 us through shared memory against 349 us over gloo on loopback (10th percentiles 18 and
232 us; [1, 576]: 16 against 326, [64, 576]: 56 against 514): at two all-reduces per layer
of 30 layers, 1.2 ms of a decode step against 21 ms. While other processes keep the
machine's cores busy, the medians rise to ~190 against ~440 us (a rank waits for its
descheduled peer) and the 10th percentiles hold.

A peer that dies fails the collective waiting for it within a second on the shared-memory
path (``shm.LIVENESS_S``) and as soon as its sockets close on gloo; a peer that hangs
fails an all-reduce or gather after ``timeout_s``. Either raises ``CommunicationError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freetoken_core.distributed.shm import (
    CommunicationError,
    ShmChannel,
    is_supported,
    open_channel,
)

__all__ = [
    "CommunicationError", "Communicator", "backend_for", "init_communicator", "shm_path",
]

DEFAULT_TIMEOUT_S = 60.0
"""How long an all-reduce or gather waits for a peer that is alive but does not arrive."""
DEFAULT_SHM_SLOT_BYTES = 16 << 20
"""The largest tensor the shared-memory path takes (a rank's part of 64 rows of logits over a
49152-token vocabulary, for rank 0's gather, is 6 MiB at TP=2); larger ones go over gloo.
The segment holds 2 x world_size slots, paged in as they are used, smaller where /dev/shm
is short of space."""
MESSAGE_BUFFER_BYTES = 4 << 20
"""The longest message the shared-memory path takes; longer ones go over gloo."""
MAX_MESSAGE_BYTES = 64 << 20
"""The longest message ``broadcast_bytes`` sends."""

_FOREVER = timedelta(days=365)


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


class Communicator:
    """One rank's end of the group. Every rank calls the same collectives in the same
    order, with tensors of one shape and dtype; a collective returns on a rank once that
    rank's part is done. After a ``CommunicationError`` the group is broken: ``close()``
    and end the process."""

    def __init__(self, rank: int, world_size: int, backend: str, group: Any, bytes_group: Any,
                 channel: ShmChannel | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._backend = backend
        self._group = group
        self._bytes_group = bytes_group
        self._channel = channel

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum the contiguous ``t`` over the ranks, in place; the same bits on every rank."""
        if self._channel is not None and self._channel.fits(t):
            self._channel.all_reduce(t)
        elif self._backend == "nccl":
            with self._failing("all_reduce"):
                self._group.allreduce([t]).wait()
        else:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            with self._failing("all_reduce"):
                self._group.allgather([parts], [t]).wait()
            _sum_in_rank_order(parts, out=t)

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's ``t``, in rank order (its own included); the others: None."""
        if self._channel is not None and self._channel.fits(t):
            return self._channel.gather_to_first(t)
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        with self._failing("gather_to_first"):
            options = dist.GatherOptions()
            options.rootRank = 0
            self._group.gather([parts] if parts is not None else [], [t.contiguous()],
                               options).wait()
        return parts

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes ``data`` (up to ``MAX_MESSAGE_BYTES``) and gets it back; the others
        pass None and receive it, waiting as long as rank 0 lives."""
        if self.rank == 0:
            if data is None or len(data) > MAX_MESSAGE_BYTES:
                raise ValueError(
                    f"broadcast_bytes sends bytes of at most {MAX_MESSAGE_BYTES} bytes, "
                    f"not {'None' if data is None else len(data)}")
            if self._channel is not None and self._channel.send_message(data):
                return data
        elif self._channel is not None:
            received = self._channel.receive_message()
            if received is not None:
                return received
        with self._failing("broadcast_bytes"):
            return self._broadcast_over_gloo(data)

    def close(self) -> None:
        """Leave the group; a peer still waiting for this rank raises."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        # Dropped, the groups close their connections (their peers' collectives fail).
        self._group = self._bytes_group = None

    def _broadcast_over_gloo(self, data: bytes | None) -> bytes:
        length = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self._bytes_group.broadcast(length, 0).wait()
        if not length.item():
            return b""
        if self.rank == 0:
            self._bytes_group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                        0).wait()
            return data
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._bytes_group.broadcast(payload, 0).wait()
        return payload.numpy().tobytes()

    @contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """torch.distributed's errors (a peer's closed socket, a timeout) as ours."""
        try:
            yield
        except RuntimeError as e:
            raise CommunicationError(
                f"rank {self.rank}: {what} failed (a peer died, closed or timed out): {e}"
            ) from e


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


def init_communicator(rank: int, world_size: int, master_addr: str, master_port: int,
                      device: torch.device, same_node: bool,
                      timeout_s: float = DEFAULT_TIMEOUT_S, *,
                      shm_slot_bytes: int = DEFAULT_SHM_SLOT_BYTES) -> Communicator:
    """Join the group whose rank 0 listens on ``master_addr:master_port``; every rank calls
    this with the same arguments but ``rank``. ``same_node``: every rank runs on this
    machine, with this /dev/shm and pid namespace (the shared-memory path, on Linux x86-64).
    ``timeout_s`` bounds start-up and every collective but ``broadcast_bytes``'s wait."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout)
        group = _process_group(backend, dist.PrefixStore("steps", store), rank, world_size,
                               timeout)
        bytes_group = _process_group("gloo", dist.PrefixStore("bytes", store), rank,
                                     world_size, _FOREVER)
        channel = None
        if same_node and is_supported():
            channel = open_channel(
                shm_path(master_addr, master_port), rank, world_size,
                lambda: bytes_group.barrier().wait(),
                slot_bytes=0 if backend == "nccl" else -(-shm_slot_bytes // 64) * 64,
                message_bytes=MESSAGE_BUFFER_BYTES, timeout_s=timeout_s)
    except (RuntimeError, OSError) as e:
        raise CommunicationError(f"rank {rank}: joining the group failed: {e}") from e
    return Communicator(rank, world_size, backend, group, bytes_group, channel)


def _process_group(backend: str, store: Any, rank: int, world_size: int,
                   timeout: timedelta) -> Any:
    """A process group of its own over ``store``, not torch.distributed's default group: a
    process may hold several (two tensor-parallel engines in one Python process), and
    leaving one is dropping it (its connections close, and its peers' collectives fail)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def shm_path(master_addr: str, master_port: int) -> str:
    """Where a group's shared-memory segment lives while its ranks map it (one name per
    group on this machine: its rank 0 holds the port)."""
    return f"/dev/shm/freetoken-comm-{re.sub(r'[^A-Za-z0-9.]', '_', master_addr)}-{master_port}"
