"""The ranks of a tensor-parallel engine (``--tensor-parallel-size N``): started, fed each
step, stopped.

Rank 0 is the engine process: it owns the scheduler, the block manager, the plugins and the
sampler, and holds its part of the model (``models/sharding.py``) and of the KV cache like
every rank. Each step it sends the step's plan (``StepPlan``: token ids, positions, block
tables; a few hundred bytes of msgpack, no sequences) to the other ranks through
``Communicator.broadcast_bytes`` (shared memory on one node), then every rank runs the same
forward pass, meeting in the all-reduces, and rank 0 gathers the logits and samples.

The other ranks are started by the backend:

- ``mp``: rank 0 starts its node's ranks as child processes (``python -m
  freetoken_core.engine.tp_rank``, which die with it: ``PR_SET_PDEATHSIG``); the
  ranks of the other nodes are started there by ``freetoken serve --headless``;
- ``ray``: one Ray actor per rank in a placement group of the running cluster.

Every rank builds the same KV cache (``--kv-cache-tokens`` slots of its KV heads), so the
block manager's blocks are valid on each. A rank that dies or stops answering breaks the
group: the waiting ranks raise ``CommunicationError`` (within a second of a death, after
``--distributed-timeout`` for a hang), rank 0's engine process exits after failing what was
in flight, its children die with it, and the server's supervisor starts a new group.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from freetoken_core.config import EngineConfig
from freetoken_core.distributed.comm import (
    CommunicationError,
    Communicator,
    init_communicator,
)
from freetoken_core.engine.model_runner import ModelRunner, StepPlan, run_plan
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.sharding import Shard

if TYPE_CHECKING:
    from freetoken_core.engine.ray_ranks import RayRanks

log = logging.getLogger("freetoken.engine")

_STOP = b""
"""The broadcast that ends the other ranks' loop (a plan is never empty)."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank other than 0 needs to join the group and load its part."""

    config: EngineConfig
    rank: int
    master_addr: str
    master_port: int
    same_node: bool
    cpus: tuple[int, ...] | None
    """CPUs to pin its threads to (one torch thread each); ``None``: unpinned."""
    status_fd: int | None = None
    """A pipe to write ``ready`` or ``failed <message>`` to once loaded (mp children)."""
    parent_pid: int | None = None
    """Die with this process (mp children)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_cpus(num_ranks: int, pin: bool = True) -> list[tuple[int, ...] | None]:
    """This node's CPUs cut into ``num_ranks`` contiguous runs, one per local rank (each
    rank's threads on cores of their own, as ``--pin-threads`` gives the engine); all
    ``None`` where ``pin`` is off, there are fewer CPUs than ranks or no way to pin."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return [None] * num_ranks
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < num_ranks:
        return [None] * num_ranks
    per, extra = divmod(len(cpus), num_ranks)
    out, start = [], 0
    for i in range(num_ranks):
        stop = start + per + (i < extra)
        out.append(tuple(cpus[start:stop]))
        start = stop
    return out


def pin(cpus: tuple[int, ...] | None) -> tuple[set[int], int] | None:
    """This thread (and the threads it starts) on ``cpus``, with as many torch threads;
    returns the CPUs and torch thread count it had (for ``unpin``), None where it did
    nothing."""
    if cpus is None:
        return None
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return before


def unpin(before: tuple[set[int], int] | None) -> None:
    """Undo ``pin``: rank 0 is the caller's thread (an ``LLM`` in a user's process, a test),
    which keeps running after the group closes."""
    if before is not None:
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for ``rank``: on CUDA, the node's GPU of its local rank (``cuda:i``; NCCL
    takes one GPU per rank); raises ``ModelLoadError`` where the node has too few."""
    device = config.torch_device()
    if device.type != "cuda" or ":" in config.device:
        return config
    local = rank % (config.tensor_parallel_size // config.nnodes)
    if local >= torch.cuda.device_count():
        raise ModelLoadError(
            f"tensor-parallel rank {rank} needs GPU {local} of its node, which has "
            f"{torch.cuda.device_count()}: one GPU per rank")
    return dataclasses.replace(config, device=f"cuda:{local}")


class TensorParallelGroup:
    """Rank 0's side of the group: ``shard`` for the model, ``send_plan`` each step."""

    def __init__(self, config: EngineConfig, comm: Communicator,
                 children: list[tuple[subprocess.Popen, int]], ray_ranks: RayRanks | None = None,
                 unpinned: tuple[set[int], int] | None = None) -> None:
        self.config = config
        self.comm = comm
        self.shard = Shard(0, config.tensor_parallel_size, comm)
        self.children = children
        """mp: this node's other ranks and the read end of each one's status pipe."""
        self.ray_ranks = ray_ranks
        self._encoder = msgspec.msgpack.Encoder()
        self.unpinned = unpinned
        """Rank 0's thread's CPUs and torch threads before the group pinned it (``close``
        gives them back)."""

    def wait_ready(self) -> None:
        """Return once every rank has loaded its part; raises ``ModelLoadError`` with a
        rank's own message where one failed."""
        deadline = time.monotonic() + max(self.config.distributed_timeout, 600.0)
        for process, fd in self.children:
            status = _read_status(process, fd, deadline)
            if status != "ready":
                raise ModelLoadError(f"tensor-parallel rank failed to load: {status}")
        # Every rank (other nodes' and Ray's too) meets here once loaded.
        try:
            self.comm.gather_to_first(torch.ones(1))
        except CommunicationError as exc:
            failure = self.ray_ranks.failure() if self.ray_ranks is not None else None
            raise ModelLoadError(f"tensor-parallel rank failed to load: {failure or exc}"
                                 ) from exc

    def send_plan(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        self.comm.broadcast_bytes(self._encoder.encode(plan))
        self.shard.times.seconds += time.perf_counter() - start
        self.shard.times.calls += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop the other ranks (tell them, then wait, then kill) and leave the group."""
        try:
            self.comm.broadcast_bytes(_STOP)
        except Exception as exc:  # noqa: BLE001 (a broken group has nothing to tell)
            log.debug("could not tell the ranks to stop: %s", exc)
        deadline = time.monotonic() + timeout
        for process, fd in self.children:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            os.close(fd)
        self.children = []
        if self.ray_ranks is not None:
            self.ray_ranks.stop()
            self.ray_ranks = None
        self.comm.close()
        unpin(self.unpinned)
        self.unpinned = None


def _read_status(process: subprocess.Popen, fd: int, deadline: float) -> str:
    """A child's status line, or why there is none (it died, or the deadline passed)."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return "it did not report within the timeout"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                code = process.wait()
                return f"it exited with status {code} before loading"
            data += chunk
    return data.decode(errors="replace").strip()


def start_group(config: EngineConfig) -> TensorParallelGroup:
    """Start the other ranks of ``config``'s group and join it as rank 0; the model is not
    loaded yet (``shard`` is for that), ``wait_ready`` then waits for theirs."""
    world = config.tensor_parallel_size
    per_node = world // config.nnodes
    rank_config(config, per_node - 1)  # a GPU for each of this node's ranks
    port = config.master_port or free_port()
    device = config.torch_device()
    cpus = rank_cpus(per_node if config.distributed_executor_backend == "mp" else 1,
                     config.pin_ranks)
    children: list[tuple[subprocess.Popen, int]] = []
    ray_ranks = unpinned = None
    addr = config.master_addr
    try:
        if config.distributed_executor_backend == "ray":
            from freetoken_core.engine.ray_ranks import start_ray_ranks

            ray_ranks = start_ray_ranks(config, port)
            addr = ray_ranks.addr
        else:
            for rank in range(1, per_node):
                children.append(_start_child(RankSpec(
                    config, rank, config.master_addr, port, config.nnodes == 1, cpus[rank],
                    parent_pid=os.getpid())))
        unpinned = pin(cpus[0])
        comm = init_communicator(0, world, addr, port, device,
                                 same_node=config.nnodes == 1
                                 and config.distributed_executor_backend == "mp",
                                 timeout_s=config.distributed_timeout)
    except BaseException:
        for process, fd in children:
            process.kill()
            process.wait()
            os.close(fd)
        if ray_ranks is not None:
            ray_ranks.stop()
        unpin(unpinned)
        raise
    return TensorParallelGroup(config, comm, children, ray_ranks, unpinned)


def _start_child(spec: RankSpec) -> tuple[subprocess.Popen, int]:
    """A rank of this node as a child process: the spec goes over its stdin."""
    read_fd, write_fd = os.pipe()
    spec = RankSpec(**{**spec.__dict__, "status_fd": write_fd})
    process = subprocess.Popen([sys.executable, "-m", "freetoken_core.engine.tp_rank"],
                               stdin=subprocess.PIPE, pass_fds=(write_fd,))
    os.close(write_fd)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process, read_fd


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``); exit now if
    it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _report(fd: int | None, text: str) -> None:
    if fd is not None:
        os.write(fd, text.encode() + b"\n")
        os.close(fd)


def run_rank(spec: RankSpec) -> None:
    """A rank other than 0: join the group, load its part of the model and KV cache, then
    run every plan rank 0 sends until it says stop or the group breaks."""
    from freetoken_core.engine.llm_engine import compute_limits, load_engine_model
    from freetoken_core.models.config import ModelConfig
    from freetoken_core.models.resolve import resolve_model

    config = rank_config(spec.config, spec.rank)
    pin(spec.cpus)
    device = config.torch_device()
    comm = init_communicator(spec.rank, config.tensor_parallel_size, spec.master_addr,
                             spec.master_port, device, same_node=spec.same_node,
                             timeout_s=config.distributed_timeout)
    try:
        try:
            model_dir = resolve_model(config.model, progress=False)
            limits = compute_limits(config, ModelConfig.from_dir(model_dir, config.hf_overrides),
                                    frozenset())
            model = load_engine_model(config, model_dir, limits,
                                      Shard(spec.rank, config.tensor_parallel_size, comm))
            kv_caches = ModelRunner(model, limits.num_kv_blocks, limits.block_size,
                                    config.kv_torch_dtype(device), device,
                                    prefault=config.kv_cache_prefault).kv_caches
        except Exception as exc:
            _report(spec.status_fd, f"failed rank {spec.rank}: {type(exc).__name__}: {exc}")
            raise
        _report(spec.status_fd, "ready")
        comm.gather_to_first(torch.ones(1))
        decoder = msgspec.msgpack.Decoder(StepPlan)
        with torch.inference_mode():
            while (data := comm.broadcast_bytes(None)) != _STOP:
                run_plan(model, kv_caches, decoder.decode(data), limits.block_size, device)
    finally:
        comm.close()


def run_headless(config: EngineConfig) -> int:
    """``freetoken serve --headless``: this node's ranks of the group whose rank 0 serves
    HTTP on node 0, as child processes; when the group breaks they exit and are started
    again, to join the group that rank 0's restarted engine forms. Ends on SIGINT/SIGTERM
    (the ranks with it); exit status 2 for a configuration that cannot work."""
    if config.nnodes < 2 or config.node_rank < 1 or config.distributed_executor_backend != "mp":
        log.error("--headless runs the ranks of node 1.. of an mp group: it needs --nnodes "
                  ">= 2, --node-rank >= 1 and --distributed-executor-backend mp")
        return 2
    logging.basicConfig(level=logging.INFO, format="freetoken headless: %(message)s")
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    cpus = rank_cpus(per_node, config.pin_ranks)
    stopping = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        children = [_start_child(RankSpec(config, first + i, config.master_addr,
                                          config.master_port, False, cpus[i],
                                          parent_pid=os.getpid())) for i in range(per_node)]
        log.info("ranks %d-%d started for the group at %s:%d", first, first + per_node - 1,
                 config.master_addr, config.master_port)
        while not stopping and all(process.poll() is None for process, _ in children):
            time.sleep(0.2)
        for process, fd in children:
            if process.poll() is None:
                process.kill()
            process.wait()
            os.close(fd)
        if not stopping:
            log.info("the group broke; starting the ranks again in 1 s")
            time.sleep(1.0)
    return 0


def main() -> None:
    """``python -m freetoken_core.engine.tp_rank``: an mp child rank, its ``RankSpec``
    pickled on stdin (from its parent only)."""
    spec: RankSpec = pickle.loads(sys.stdin.buffer.read())
    if spec.parent_pid is not None:
        _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops the group in order
    logging.basicConfig(level=logging.WARNING,
                        format=f"freetoken rank {spec.rank}: %(levelname)s %(message)s")
    try:
        run_rank(spec)
    except Exception as exc:  # noqa: BLE001 (reported, then a non-zero exit)
        log.error("rank %d stopped: %s: %s", spec.rank, type(exc).__name__, exc)
        sys.exit(1)

