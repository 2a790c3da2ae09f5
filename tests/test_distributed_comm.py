"""The tensor-parallel communicator between real processes on loopback: the shared-memory
path (``same_node=True``) and gloo (``same_node=False``), with 2 and 3 ranks.

Each group is a set of processes that run one scenario (a module-level function of the
communicator) and send its result back; the checks run here, against sums computed here in
rank order. The ranks start from a fork server that has imported torch once: each is a
fresh process, as a spawned one would be, without spending seconds importing torch.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from freetoken_core.distributed.comm import (
    MAX_MESSAGE_BYTES,
    CommunicationError,
    Communicator,
    backend_for,
    init_communicator,
    shm_path,
)

PATHS = {"shm": True, "gloo": False}
GROUPS = [(2, "shm"), (3, "shm"), (2, "gloo"), (3, "gloo")]
SLOT_BYTES = 64 << 10
"""The shm slot of the collectives' groups: [16, 576] float32 fits, [64, 576] goes by gloo."""
SHAPES = [(1,), (7,), (16, 576), (3, 5, 11), (64, 576), ()]
MESSAGE_SIZES = [0, 1, 1000, 3 << 20, 6 << 20]
"""Empty, small, multi-MB through the shm buffer (4 MiB), and past it (over gloo)."""
FAR_FUTURE_S = 30.0
"""A collective timeout that a test never reaches: a failure it sees is a peer's death."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(scenario: Callable[[Communicator], Any], rank: int, world_size: int, port: int,
               same_node: bool, timeout_s: float, init_kwargs: dict, results: Any) -> None:
    torch.set_num_threads(1)
    comm = None
    try:
        comm = init_communicator(rank, world_size, "127.0.0.1", port, torch.device("cpu"),
                                 same_node, timeout_s, **init_kwargs)
        outcome = scenario(comm)
    except CommunicationError as e:
        outcome = e
    results.put((rank, outcome))
    if comm is not None:
        comm.close()


def run_group(scenario: Callable[[Communicator], Any], world_size: int, path: str, *,
              port: int | None = None, reporting: tuple[int, ...] | None = None,
              timeout_s: float = FAR_FUTURE_S, **init_kwargs: Any) -> dict[int, Any]:
    """Run ``scenario`` on every rank of a group; what the ranks in ``reporting`` (default
    all) returned or raised (a ``CommunicationError``), by rank."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "freetoken_core.distributed.comm"])
    results = context.Queue()
    port = port or _free_port()
    ranks = [context.Process(target=_rank_main, args=(
        scenario, rank, world_size, port, PATHS[path], timeout_s, init_kwargs, results))
        for rank in range(world_size)]
    for process in ranks:
        process.start()
    reporting = tuple(range(world_size)) if reporting is None else reporting
    outcomes: dict[int, Any] = {}
    try:
        while not outcomes.keys() >= set(reporting):
            rank, outcome = results.get(timeout=60)
            outcomes[rank] = outcome
        return {rank: outcomes[rank] for rank in reporting}
    finally:
        for rank, process in enumerate(ranks):
            process.join(timeout=10 if rank in reporting else 0)
            if process.is_alive():
                process.kill()
                process.join()


def _input(rank: int, case: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor for ``case``: values of mixed magnitudes, so that summing in
    another order changes some bits."""
    generator = torch.Generator().manual_seed(1000 * case + rank)
    scale = 10.0 ** torch.randint(-3, 4, shape, generator=generator)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _cases() -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(shape, torch.float32) for shape in SHAPES] + [((16, 576), torch.bfloat16)]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _message(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def _collectives(comm: Communicator) -> dict[str, list]:
    reduced, gathered, messages = [], [], []
    for case, (shape, dtype) in enumerate(_cases()):
        t = _input(comm.rank, case, shape, dtype)
        comm.all_reduce(t)
        reduced.append(_bits(t))
        parts = comm.gather_to_first(_input(comm.rank, case, shape, dtype))
        gathered.append(parts if parts is None else [_bits(part) for part in parts])
    for size in MESSAGE_SIZES:
        data = comm.broadcast_bytes(_message(size) if comm.rank == 0 else None)
        messages.append(hashlib.sha256(data).hexdigest())
    return {"reduced": reduced, "gathered": gathered, "messages": messages,
            "wrong in a row": _interleaved(comm, 1000)}


@pytest.fixture(scope="module", params=GROUPS, ids=[f"{p}-{w}ranks" for w, p in GROUPS])
def collectives(request: pytest.FixtureRequest) -> tuple[int, dict[int, dict[str, list]]]:
    world_size, path = request.param
    return world_size, run_group(_collectives, world_size, path, shm_slot_bytes=SLOT_BYTES)


def test_all_reduce_is_the_rank_order_sum_bit_for_bit_on_every_rank(collectives) -> None:
    world_size, results = collectives
    for case, (shape, dtype) in enumerate(_cases()):
        inputs = [_input(rank, case, shape, dtype) for rank in range(world_size)]
        expected = inputs[0] + inputs[1]
        for t in inputs[2:]:
            expected += t
        for rank in range(world_size):
            assert results[rank]["reduced"][case] == _bits(expected), (shape, dtype, rank)


def test_gather_to_first_gives_rank_0_every_tensor_in_rank_order(collectives) -> None:
    world_size, results = collectives
    for case, (shape, dtype) in enumerate(_cases()):
        expected = [_bits(_input(rank, case, shape, dtype)) for rank in range(world_size)]
        assert results[0]["gathered"][case] == expected
        assert all(results[rank]["gathered"][case] is None for rank in range(1, world_size))


def test_broadcast_bytes_delivers_every_message_to_every_rank(collectives) -> None:
    world_size, results = collectives
    expected = [hashlib.sha256(_message(size)).hexdigest() for size in MESSAGE_SIZES]
    for rank in range(world_size):
        assert results[rank]["messages"] == expected


def _interleaved(comm: Communicator, count: int) -> list[str]:
    """``count`` all-reduces of exactly summable values, shapes changing, with gathers and
    broadcasts among them; what came out wrong."""
    wrong = []
    world = range(comm.world_size)
    for i in range(count):
        t = torch.full((i % 5 + 1, 3), float(8 * i + comm.rank))
        comm.all_reduce(t)
        if not torch.all(t == sum(8 * i + r for r in world)):
            wrong.append(f"all_reduce {i}")
        if i % 7 == 0:
            parts = comm.gather_to_first(torch.tensor([i, comm.rank]))
            if comm.rank == 0 and [p.tolist() for p in parts] != [[i, r] for r in world]:
                wrong.append(f"gather {i}")
        if i % 11 == 0:
            data = comm.broadcast_bytes(str(i).encode() if comm.rank == 0 else None)
            if data != str(i).encode():
                wrong.append(f"broadcast {i}")
    return wrong


def test_a_thousand_collectives_in_a_row_never_mix_up(collectives) -> None:
    world_size, results = collectives
    assert all(results[rank]["wrong in a row"] == [] for rank in range(world_size))


def _die_in(comm: Communicator, dying_rank: int, collective: str) -> tuple[str, float] | None:
    """Every rank does one ``collective``; then ``dying_rank`` is killed and the others do
    another: what they raised and after how long."""
    def run() -> None:
        if collective == "all_reduce":
            comm.all_reduce(torch.ones(4))
        else:
            comm.broadcast_bytes(b"step" if comm.rank == 0 else None)

    run()
    if comm.rank == dying_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        run()
    except CommunicationError as e:
        return str(e), time.monotonic() - start
    return None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("collective", "dying_rank"), [("all_reduce", 1),
                                                         ("broadcast_bytes", 0)])
def test_a_killed_peer_fails_the_survivor_at_once(path: str, collective: str,
                                                  dying_rank: int) -> None:
    port = _free_port()
    survivor = 1 - dying_rank
    results = run_group(functools.partial(_die_in, dying_rank=dying_rank, collective=collective),
                        2, path, port=port, reporting=(survivor,))
    assert results[survivor] is not None, "the survivor's collective completed"
    message, waited_s = results[survivor]
    assert waited_s < FAR_FUTURE_S / 2, message  # the death was seen, not the timeout
    if path == "shm":
        assert f"rank {dying_rank} (pid" in message and "died" in message
    assert not os.path.exists(shm_path("127.0.0.1", port))


def _stall(comm: Communicator) -> str | None:
    """Rank 1 never arrives at the all-reduce that rank 0 waits in."""
    if comm.rank == 1:
        time.sleep(FAR_FUTURE_S)
        return None
    try:
        comm.all_reduce(torch.ones(4))
    except CommunicationError as e:
        return str(e)
    return None


def test_a_peer_that_never_arrives_fails_the_wait_after_the_timeout() -> None:
    results = run_group(_stall, 2, "shm", reporting=(0,), timeout_s=3.0)
    assert "rank 0: rank(s) [1] did not reach all_reduce" in results[0]


def _idle_receive(comm: Communicator) -> tuple[float, float] | None:
    """Rank 0 broadcasts after a while; rank 1's CPU time and wall time in the wait."""
    if comm.rank == 0:
        time.sleep(2.0)
        comm.broadcast_bytes(b"wake up")
        return None
    cpu, wall = time.process_time(), time.monotonic()
    comm.broadcast_bytes(None)
    return time.process_time() - cpu, time.monotonic() - wall


def test_a_receiver_idle_in_broadcast_bytes_sleeps_instead_of_spinning() -> None:
    cpu_s, wall_s = run_group(_idle_receive, 2, "shm", reporting=(1,))[1]
    assert wall_s > 1.0
    assert cpu_s < wall_s / 4


def _nothing(comm: Communicator) -> None:
    return None


def test_no_segment_is_left_in_dev_shm_after_close_even_over_a_stale_one() -> None:
    port = _free_port()
    path = shm_path("127.0.0.1", port)
    with open(path, "wb") as stale:  # a crashed group's leftover, of the wrong size
        stale.write(b"stale")
    run_group(_nothing, 2, "shm", port=port)
    assert not os.path.exists(path)


def test_broadcast_bytes_refuses_a_message_past_the_maximum() -> None:
    comm = _alone()
    try:
        with pytest.raises(ValueError, match="at most"):
            comm.broadcast_bytes(bytes(MAX_MESSAGE_BYTES + 1))
        with pytest.raises(ValueError, match="not None"):
            comm.broadcast_bytes(None)
        assert comm.broadcast_bytes(b"alone") == b"alone"
    finally:
        comm.close()


def _alone() -> Communicator:
    """A group of one rank in this process, on the shared-memory path."""
    return init_communicator(0, 1, "127.0.0.1", _free_port(), torch.device("cpu"), True)


def test_collectives_run_in_and_out_of_inference_mode_alike() -> None:
    comm = _alone()
    try:
        with torch.inference_mode():
            comm.all_reduce(torch.ones(4))
        t = torch.ones(4)
        comm.all_reduce(t)  # the same shape's slots, first seen in inference mode
        assert t.tolist() == [1.0] * 4
        assert comm.gather_to_first(t)[0].tolist() == [1.0] * 4
    finally:
        comm.close()


def _statvfs_with_free(free_bytes: int) -> Callable[[str], os.statvfs_result]:
    real = os.statvfs

    def statvfs(path: str) -> os.statvfs_result:
        stat = list(real(path))
        stat[0], stat[1], stat[4] = 4096, 4096, free_bytes // 4096  # f_bsize, f_frsize, f_bavail
        return os.statvfs_result(stat)

    return statvfs


def test_a_small_dev_shm_gets_smaller_slots_and_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(os, "statvfs", _statvfs_with_free(20 << 20))
    comm = _alone()
    try:
        assert "tensors above 1022 KiB go over gloo" in caplog.text
        for size in (1000, 1 << 20):  # through the slot, and past it
            t = torch.arange(size, dtype=torch.float32)
            comm.all_reduce(t)
            assert torch.equal(t, torch.arange(size, dtype=torch.float32))
    finally:
        comm.close()


def test_a_dev_shm_too_small_for_the_messages_fails_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "statvfs", _statvfs_with_free(8 << 20))
    with pytest.raises(CommunicationError, match="enlarge it"):
        _alone()
    assert not torch.distributed.is_initialized()


def test_backend_for_names_nccl_for_cuda_and_gloo_otherwise() -> None:
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
