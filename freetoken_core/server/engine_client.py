"""The server's handle on the engine process: start it, feed it, read it, stop it.

One reader thread receives the engine's messages and hands them to the asyncio loop with
``call_soon_threadsafe``; everything else runs on the loop's thread, so no lock guards
the per-request queues. Sends are short blocking writes of a few hundred bytes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from freetoken_core.config import EngineConfig
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.engine_process import (
    AbortRequest,
    AddRequest,
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
    params_to_wire,
    run_engine_process,
)


class EngineDeadError(FreeTokenError):
    """The engine process failed to load or exited; the message says why."""


@dataclass(frozen=True)
class EngineInfo:
    """What ``Ready`` told about the loaded model."""

    model_dir: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int


class EngineClient:
    """Owns the engine child process. Use on one asyncio loop: ``start()``, then
    ``wait_ready()``, then ``generate`` / ``abort`` / ``stop_sequence`` / ``stats``, and
    ``shutdown()`` exactly once at the end (it is also safe if start-up failed).

    ``on_dead(message)`` runs on the loop when the engine fails to load or dies.
    """

    def __init__(self, config: EngineConfig,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.info: EngineInfo | None = None
        self.dead_message: str | None = None
        self._on_dead = on_dead
        self._closing = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._queues: dict[str, asyncio.Queue[Update | Exception]] = {}
        self._stats_waiters: deque[asyncio.Future[Stats]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[EngineInfo] | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.dead_message is None

    def start(self) -> None:
        """Spawn the engine process and the reader thread; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        to_engine_r, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_w = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_engine_process, name="freetoken-engine",
                                    args=(self.config, to_engine_r, from_engine_w),
                                    daemon=True)
        self._process.start()
        # The child holds its own copies; closing ours lets EOF reach each side.
        to_engine_r.close()
        from_engine_w.close()
        self._thread = threading.Thread(target=self._read, name="freetoken-engine-reader",
                                        daemon=True)
        self._thread.start()

    async def wait_ready(self) -> EngineInfo:
        """The model's info once loaded; raises ``EngineDeadError`` if loading failed."""
        assert self._ready is not None, "start() first"
        return await asyncio.shield(self._ready)

    # -- the reader thread -------------------------------------------------------------

    def _read(self) -> None:
        assert self._loop is not None
        try:
            while True:
                message = self._decoder.decode(self._from_engine.recv_bytes())
                self._loop.call_soon_threadsafe(self._dispatch, message)
        except (EOFError, OSError):
            pass
        process = self._process
        if process is not None:
            process.join(2.0)  # EOF usually comes just before the exit
        code = process.exitcode if process is not None else None
        try:
            self._loop.call_soon_threadsafe(
                self._die, f"the engine process exited (exit code {code})")
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, StepUpdates):
            for update in message.updates:
                queue = self._queues.get(update.request_id)
                if queue is not None:
                    queue.put_nowait(update)
        elif isinstance(message, RequestFailed):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(InvalidRequest(message.param, message.message))
        elif isinstance(message, Stats):
            if self._stats_waiters:
                waiter = self._stats_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(message)
        elif isinstance(message, Ready):
            self.info = EngineInfo(message.model_dir, message.vocab_size,
                                   frozenset(message.eos_token_ids), message.max_model_len)
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(self.info)
        elif isinstance(message, LoadFailed):
            self._die(f"the engine could not load the model: {message.message}")

    def _die(self, message: str) -> None:
        if self.dead_message is not None:
            return
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
        if self._on_dead is not None and not self._closing:
            self._on_dead(message)

    # -- requests ----------------------------------------------------------------------

    def _send(self, message: ToEngine) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        self._to_engine.send_bytes(self._encoder.encode(message))

    async def generate(self, prompts: list[tuple[str, list[int]]],
                       params: SamplingParams) -> AsyncIterator[Update]:
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
        wire = params_to_wire(params)
        try:
            for request_id, token_ids in prompts:
                self._queues[request_id] = queue
                self._send(AddRequest(request_id, token_ids, wire))
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
                    self._send(AbortRequest(request_id))

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
        still waiting get an error; the exit is not reported through ``on_dead``."""
        process = self._process
        if process is None:
            return
        self._closing = True
        try:
            if process.is_alive():
                self._to_engine.send_bytes(self._encoder.encode(Shutdown()))
        except (OSError, ValueError):
            pass
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
        self.dead_message = self.dead_message or "the engine was shut down"
        self._to_engine.close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._from_engine.close()
        self._process = None
