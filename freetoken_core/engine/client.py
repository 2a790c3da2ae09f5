"""The server's handle on the engine process: start it, feed it, read it, supervise it.

One reader thread per engine process receives its messages and hands them to the asyncio
loop with ``call_soon_threadsafe``; everything else runs on the loop's thread, so no lock
guards the per-request queues. Sends are short blocking writes of a few hundred bytes.

Supervision: if the engine process exits after it was ready (killed, out of memory, a
native crash), every in-flight request fails at once with ``EngineDeadError`` (HTTP 503),
``ready`` turns false (``/health`` 503, new requests 503 with ``Retry-After``), and a new
engine process is started after a back-off delay: ``RestartPolicy.initial_delay_s``,
doubling per consecutive crash up to ``max_delay_s``; an engine that stayed up for
``stable_after_s`` resets the count. A failure to load the model the first time is fatal
(``on_dead``); after a restart it is retried like a crash.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from freetoken_core.affinity import CpuPlan, pin_process
from freetoken_core.config import EngineConfig
from freetoken_core.engine.generation_defaults import GenerationDefaults
from freetoken_core.engine.process import (
    AbortRequest,
    FromEngine,
    LoadFailed,
    Ready,
    RequestFailed,
    Shutdown,
    Stats,
    StatsQuery,
    StepUpdates,
    StopSequence,
    ToEngine,
    Update,
    add_request,
    run_engine_process,
)
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.faults import RequestError
from freetoken_core.sampling_params import SamplingParams

log = logging.getLogger("freetoken.server")


SHAPE_CACHE_ENTRIES = 256
"""Entries of oneDNN's primitive cache and of ideep's computation cache in the engine
process (torch's defaults: 1,024 each). Both are keyed by the shapes of a step's GEMMs,
which vary with the number of tokens a step computes, so their memory grows until they
are full: at 256 entries the engine's memory settles after a few hundred requests, with
the shapes of steady decoding still cached. The environment variables of
``SHAPE_CACHE_VARS`` override it."""
SHAPE_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass(frozen=True)
class RestartPolicy:
    """How the engine process is restarted after it dies (``freetoken serve`` flags
    ``--engine-restart-delay`` and ``--engine-restart-max-delay``)."""

    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    """An engine that ran this long before dying restarts after ``initial_delay_s`` again."""

    def __post_init__(self) -> None:
        if not (0 <= self.initial_delay_s <= self.max_delay_s and math.isfinite(
                self.max_delay_s)):
            raise InvalidRequest("engine_restart_delay", "engine restart delays must be "
                                 "finite and satisfy 0 <= delay <= max delay")

    def delay(self, num_consecutive: int) -> float:
        return min(self.max_delay_s, self.initial_delay_s * 2 ** max(0, num_consecutive - 1))


class EngineDeadError(FreeTokenError):
    """The engine process failed to load or exited; the message says why."""


@dataclass(frozen=True)
class EngineInfo:
    """What ``Ready`` told about the loaded model."""

    model_dir: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


class EngineClient:
    """Owns the engine child process. Use on one asyncio loop: ``start()``, then
    ``wait_ready()``, then ``generate`` / ``abort`` / ``stop_sequence`` / ``stats``, and
    ``shutdown()`` exactly once at the end (it is also safe if start-up failed).

    ``on_dead(message)`` runs on the loop when the engine fails to load the first time
    (fatal). Later deaths are survived: see the module docstring. ``num_restarts`` counts
    engine processes started after the first; ``retry_after_s`` is a client's best wait.
    """

    def __init__(self, config: EngineConfig,
                 on_dead: Callable[[str], None] | None = None,
                 restart: RestartPolicy | None = None,
                 on_failure: Callable[[RequestFailed], None] | None = None,
                 cpu_plan: CpuPlan | None = None) -> None:
        """``on_failure(message)`` runs on the loop for every request the engine failed
        (``status`` 500), for the metrics. ``cpu_plan``: pin the engine's threads and, once
        the engine process is started, this process's threads to it (freetoken_core.affinity);
        ``None``: pin nothing."""
        self.config = config
        self.cpu_plan = cpu_plan
        self.restart_policy = restart or RestartPolicy()
        self.info: EngineInfo | None = None
        self.dead_message: str | None = None
        self.num_restarts = 0
        self._on_dead = on_dead
        self._on_failure = on_failure
        self._closing = False
        self._fatal = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._queues: dict[str, asyncio.Queue[Update | Exception]] = {}
        self._stats_waiters: deque[asyncio.Future[Stats]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[EngineInfo] | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        self._generation = 0
        self._started_at = 0.0
        self._num_crashes = 0
        self._restart_at: float | None = None
        self._restart_handle: asyncio.TimerHandle | None = None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.dead_message is None

    @property
    def retry_after_s(self) -> int:
        """Seconds a client should wait before retrying while the engine is not ready."""
        if self._restart_at is None:
            return 1
        return max(1, math.ceil(self._restart_at - time.monotonic()))

    def start(self) -> None:
        """Spawn the engine process and its reader thread; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._spawn()
        if self.cpu_plan is not None:
            # Once, after the first start: every engine process pins itself from the plan,
            # not from the CPUs it inherits from this one.
            pin_process(self.cpu_plan.shared)

    def _spawn(self) -> None:
        for var in SHAPE_CACHE_VARS:  # read by the child's torch at its first GEMM
            os.environ.setdefault(var, str(SHAPE_CACHE_ENTRIES))
        self._generation += 1
        self._started_at = time.monotonic()
        ctx = multiprocessing.get_context("spawn")
        to_engine_r, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_w = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_engine_process, name="freetoken-engine",
                                    args=(self.config, to_engine_r, from_engine_w,
                                          self.cpu_plan),
                                    daemon=True)
        self._process.start()
        # The child holds its own copies; closing ours lets EOF reach each side.
        to_engine_r.close()
        from_engine_w.close()
        self._thread = threading.Thread(
            target=self._read, args=(self._generation, self._process, self._from_engine),
            name="freetoken-engine-reader", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> EngineInfo:
        """The model's info once loaded; raises ``EngineDeadError`` if loading failed."""
        assert self._ready is not None, "start() first"
        return await asyncio.shield(self._ready)

    # -- the reader thread -------------------------------------------------------------

    def _read(self, generation: int, process: multiprocessing.process.BaseProcess,
              conn: multiprocessing.connection.Connection) -> None:
        assert self._loop is not None
        try:
            while True:
                message = self._decoder.decode(conn.recv_bytes())
                self._loop.call_soon_threadsafe(self._dispatch, generation, message)
        except (EOFError, OSError):
            pass
        process.join(2.0)  # EOF usually comes just before the exit
        try:
            self._loop.call_soon_threadsafe(
                self._exited, generation, f"the engine process exited (exit code "
                                          f"{process.exitcode})")
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    def _dispatch(self, generation: int, message: FromEngine) -> None:
        if generation != self._generation:
            return  # a message of an engine process that was replaced
        if isinstance(message, StepUpdates):
            for update in message.updates:
                queue = self._queues.get(update.request_id)
                if queue is not None:
                    queue.put_nowait(update)
        elif isinstance(message, RequestFailed):
            if message.status >= 500 and self._on_failure is not None:
                self._on_failure(message)
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(_request_error(message))
        elif isinstance(message, Stats):
            if self._stats_waiters:
                waiter = self._stats_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(message)
        elif isinstance(message, Ready):
            self.info = EngineInfo(message.model_dir, message.vocab_size,
                                   frozenset(message.eos_token_ids), message.max_model_len,
                                   message.generation_defaults)
            if self.dead_message is not None:
                log.warning("the engine process is ready again (restart %d)",
                            self.num_restarts)
            self.dead_message = None
            self._restart_at = None
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(self.info)
        elif isinstance(message, LoadFailed):
            self._exited(generation, f"the engine could not load the model: {message.message}")

    def _exited(self, generation: int, message: str) -> None:
        """The engine process of ``generation`` is gone (or failed to load)."""
        if generation != self._generation or self._closing or self._fatal:
            return
        if self.info is None:
            self._fatal = True  # never loaded: the operator must fix something
            self._fail_in_flight(message)
            if self._on_dead is not None:
                self._on_dead(message)
            return
        if time.monotonic() - self._started_at >= self.restart_policy.stable_after_s:
            self._num_crashes = 0
        self._num_crashes += 1
        delay = self.restart_policy.delay(self._num_crashes)
        log.error("%s; restarting it in %.1f s (crash %d in a row)", message, delay,
                  self._num_crashes)
        self._fail_in_flight(f"{message}; the engine is restarting")
        self._generation += 1  # ignore anything the old reader still delivers
        self._restart_at = time.monotonic() + delay
        assert self._loop is not None
        self._restart_handle = self._loop.call_later(delay, self._restart)

    def _fail_in_flight(self, message: str) -> None:
        self.dead_message = message
        error = EngineDeadError(message)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here; wait_ready() re-raises it
        for queue in self._queues.values():
            queue.put_nowait(error)
        while self._stats_waiters:
            waiter = self._stats_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _restart(self) -> None:
        self._restart_handle = None
        if self._closing:
            return
        self._close_process(timeout=1.0)
        self.num_restarts += 1
        log.warning("starting a new engine process (restart %d)", self.num_restarts)
        self._spawn()

    def _close_process(self, timeout: float) -> None:
        """Stop the current process (terminate, then kill) and close its pipes."""
        process = self._process
        if process is None:
            return
        process.join(timeout if process.is_alive() else 0)
        if process.is_alive():
            process.terminate()
            process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
        self._to_engine.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._from_engine.close()
        self._process = None

    # -- requests ----------------------------------------------------------------------

    def _send(self, message: ToEngine) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        self._to_engine.send_bytes(self._encoder.encode(message))

    async def generate(self, prompts: list[tuple[str, list[int]]],
                       params: SamplingParams, is_chat: bool = False
                       ) -> AsyncIterator[Update]:
        """Submit every ``(request_id, prompt_token_ids)`` together and yield their
        updates as they come, until the engine has finished each of the
        ``len(prompts) * params.n`` choices. Raises ``InvalidRequest`` if the engine refuses
        one (the others are aborted) and ``EngineDeadError`` if the engine dies.

        The caller may stop iterating early: when it ended the remaining choices itself
        with ``stop_sequence``, or when its client went away. Leaving before the engine
        finished every choice aborts the requests, which frees their KV blocks.
        """
        queue: asyncio.Queue[Update | Exception] = asyncio.Queue()
        ids = [request_id for request_id, _ in prompts]
        unfinished = {(request_id, i) for request_id in ids for i in range(params.n)}
        try:
            for request_id, token_ids in prompts:
                self._queues[request_id] = queue
                self._send(add_request(request_id, token_ids, params, is_chat))
            while unfinished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    unfinished.discard((item.request_id, item.index))
                yield item
        finally:
            for request_id in ids:
                self._queues.pop(request_id, None)
            if unfinished and self.dead_message is None:
                for request_id in {r for r, _ in unfinished}:
                    try:
                        self._send(AbortRequest(request_id))
                    except (FreeTokenError, OSError):
                        break  # the engine died meanwhile: nothing left to abort

    def stop_sequence(self, request_id: str, index: int, stop_reason: int | str | None) -> None:
        """Ask the engine to end one choice (its KV blocks are freed on the next step)."""
        self._send(StopSequence(request_id, index, stop_reason))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def stats(self) -> Stats:
        """Running and waiting sequences, live requests and KV blocks, between two steps."""
        assert self._loop is not None
        waiter: asyncio.Future[Stats] = self._loop.create_future()
        self._stats_waiters.append(waiter)
        self._send(StatsQuery())
        return await waiter

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process: ask, then terminate, then kill; always joins it. Requests
        still waiting get an error; the exit is not reported through ``on_dead`` and no
        restart follows."""
        self._closing = True
        if self._restart_handle is not None:
            self._restart_handle.cancel()
        process = self._process
        if process is None:
            return
        try:
            if process.is_alive():
                self._to_engine.send_bytes(self._encoder.encode(Shutdown()))
        except (OSError, ValueError):
            pass
        self._close_process(timeout)
        self.dead_message = self.dead_message or "the engine was shut down"


def _request_error(message: RequestFailed) -> FreeTokenError:
    """The exception a ``RequestFailed`` raises in the request's handler."""
    if message.status < 500:
        return InvalidRequest(message.param, message.message, message.code)
    return RequestError(message.stage or "engine", message.message, message.plugin)
