"""The engine core in its own process, fed and read over msgspec messages.

The server process starts ``run_engine_process`` in a child made with the ``spawn``
context and talks to it over two one-way ``multiprocessing`` pipes of msgpack-encoded
messages (``send_bytes`` / ``recv_bytes``):

* server → engine (``ToEngine``): ``AddRequest``, ``AbortRequest``, ``StopSequence``,
  ``StatsQuery``, ``Shutdown``;
* engine → server (``FromEngine``): first exactly one of ``Ready`` (the model is loaded)
  or ``LoadFailed`` (one line for the operator; the child then exits), then
  ``StepUpdates`` (one message per engine step that produced tokens), ``RequestFailed``
  (an ``AddRequest`` the engine refused; nothing else comes for that request) and
  ``Stats`` (one per ``StatsQuery``, in order).

The loop blocks on the input pipe while there is no work, and otherwise drains every
waiting message between two steps, so an abort frees its KV blocks before the next step.
The child exits on ``Shutdown`` or when the server's end of a pipe closes.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from freetoken_core.affinity import CpuPlan, pin_engine_threads
from freetoken_core.config import EngineConfig
from freetoken_core.engine.generation_defaults import GenerationDefaults
from freetoken_core.errors import CommunicationError, FreeTokenError, InvalidRequest
from freetoken_core.faults import RequestError
from freetoken_core.outputs import PromptLogprobs
from freetoken_core.processors import RequestFields
from freetoken_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_core.engine.core import SeqUpdate

log = logging.getLogger("freetoken.engine")


class AddRequest(msgspec.Struct, tag=True):
    """Start ``request_id``, validated by the server: ``params`` are the core fields
    (``SamplingParams.core_fields()``), ``fields`` the typed ``Fields`` of each plugin the
    request uses, by plugin name. The engine decodes ``fields`` into those types
    (``to_engine_type``) and validates nothing again."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    fields: Any = None
    is_chat: bool = False


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class StopSequence(msgspec.Struct, tag=True):
    """End choice ``index`` of ``request_id`` (a stop string matched in the server)."""

    request_id: str
    index: int
    stop_reason: int | str | None


class StatsQuery(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    """The model is loaded; what the server needs to validate and tokenize requests
    (``generation_defaults``: what it fills into requests before it validates them)."""

    model_dir: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    generation_defaults: GenerationDefaults = GenerationDefaults()


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class Update(msgspec.Struct, array_like=True):
    """One sequence's step: the ``SeqUpdate`` fields the server needs. ``logprob`` and
    ``top_logprobs`` (``(token_id, logprob)``, most likely first) are set only when the
    request asked for ``SamplingParams.logprobs``. ``token_id`` is ``None`` when the choice
    generates nothing (``max_tokens == 0``); ``prompt_logprobs`` comes once per request, as
    ``SeqUpdate`` says."""

    request_id: str
    index: int
    token_id: int | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class StepUpdates(msgspec.Struct, tag=True):
    updates: list[Update]


class RequestFailed(msgspec.Struct, tag=True):
    """The engine refused (``status`` 400: ``param`` and ``code`` name what is wrong) or
    failed (``status`` 500: ``stage`` and ``plugin`` name where) ``request_id``; nothing
    more comes for it, and its KV blocks are already free."""

    request_id: str
    param: str | None
    message: str
    status: int = 400
    code: str | None = None
    stage: str | None = None
    plugin: str | None = None

    @classmethod
    def of(cls, request_id: str, exc: FreeTokenError) -> RequestFailed:
        if isinstance(exc, RequestError):
            return cls(request_id, None, exc.message, exc.status, exc.code, exc.stage,
                       exc.plugin)
        if isinstance(exc, InvalidRequest):
            return cls(request_id, exc.param, exc.message, 400, exc.code)
        return cls(request_id, None, str(exc), 500, "engine_error", "engine")


class Stats(msgspec.Struct, tag=True):
    """Engine load: sequences running and waiting, live requests, KV blocks in use, and
    how many live requests were aborted since start; and the engine steps' wall time since
    start (``EngineCore.step_times``: every step's as histogram bucket counts, the decode
    steps' as a sum and a count)."""

    num_running: int
    num_waiting: int
    num_requests: int
    num_used_kv_blocks: int
    num_kv_blocks: int
    num_aborted_requests: int
    num_steps: int = 0
    step_seconds: float = 0.0
    step_bucket_counts: list[int] = []
    num_decode_steps: int = 0
    decode_step_seconds: float = 0.0
    comm_seconds: float = 0.0
    """Tensor parallelism: rank 0's time in the group's collectives (``CommTimes``)."""
    num_comm_calls: int = 0


ToEngine = AddRequest | AbortRequest | StopSequence | StatsQuery | Shutdown
FromEngine = Ready | LoadFailed | StepUpdates | RequestFailed | Stats


def add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                is_chat: bool = False) -> AddRequest:
    """The message that starts one validated request in the engine process."""
    return AddRequest(request_id, prompt_token_ids, params.core_fields(), params.fields,
                      is_chat)


def to_engine_type(fields_types: dict[str, type[RequestFields]]) -> Any:
    """``ToEngine`` with ``AddRequest.fields`` typed: a struct with one optional field per
    plugin, of that plugin's ``Fields`` type, so the decoder rebuilds them."""
    plugin_fields = msgspec.defstruct(
        "PluginFields", [(name, cls | None, None) for name, cls in fields_types.items()],
        kw_only=True, omit_defaults=True)
    typed = msgspec.defstruct(
        "AddRequest", [("request_id", str), ("prompt_token_ids", list[int]),
                       ("params", dict[str, Any]), ("fields", plugin_fields | None, None),
                       ("is_chat", bool, False)], tag="AddRequest")
    return typed | AbortRequest | StopSequence | StatsQuery | Shutdown


def params_of(message: Any) -> SamplingParams:
    """The ``SamplingParams`` an ``AddRequest`` (decoded as ``to_engine_type`` says)
    carries, trusted as the server validated them."""
    plugin_fields = message.fields
    fields = {} if plugin_fields is None else {
        name: value for name in plugin_fields.__struct_fields__
        if (value := getattr(plugin_fields, name)) is not None}
    return SamplingParams.trusted(message.params, fields)


class _Engine:
    """The child's side: one built engine and the message loop around it."""

    def __init__(self, config: EngineConfig, conn_in: Connection, conn_out: Connection) -> None:
        from freetoken_core.engine.llm_engine import build_engine

        self.parts = build_engine(config, progress=False)
        self.core = self.parts.core
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(
            to_engine_type(self.parts.plugins.fields_types()))
        self.running = True
        self.num_aborted = 0

    def send(self, message: FromEngine) -> None:
        self.conn_out.send_bytes(self.encoder.encode(message))

    def comm_times(self) -> tuple[float, int]:
        group = self.parts.group
        return (0.0, 0) if group is None else (group.shard.times.seconds,
                                               group.shard.times.calls)

    def handle(self, message: Any) -> None:
        if type(message).__name__ == "AddRequest":
            try:
                self.core.add_request(message.request_id, message.prompt_token_ids,
                                      params_of(message), message.is_chat)
            except FreeTokenError as exc:
                self.send(RequestFailed.of(message.request_id, exc))
            except Exception as exc:  # a bug fails this request only
                log.error("adding request %s failed", message.request_id, exc_info=exc)
                self.core.abort_request(message.request_id)
                self.send(RequestFailed.of(message.request_id, RequestError(
                    "engine", f"the engine failed to add the request: "
                              f"{type(exc).__name__}: {exc}")))
        elif isinstance(message, AbortRequest):
            num_live = self.core.num_requests
            self.core.abort_request(message.request_id)
            self.num_aborted += self.core.num_requests < num_live
        elif isinstance(message, StopSequence):
            self.core.stop_sequence(message.request_id, message.index, message.stop_reason)
        elif isinstance(message, StatsQuery):
            scheduler = self.core.scheduler
            times = self.core.step_times
            self.send(Stats(len(scheduler.running), len(scheduler.waiting),
                            self.core.num_requests, scheduler.block_manager.num_used_blocks,
                            scheduler.block_manager.num_blocks, self.num_aborted,
                            times.count, times.seconds, list(times.bucket_counts),
                            times.decode_count, times.decode_seconds,
                            *self.comm_times()))
        elif isinstance(message, Shutdown):
            self.running = False

    def loop(self) -> None:
        while self.running:
            # Block while idle; between steps take whatever has arrived.
            if not self.core.has_unfinished or self.conn_in.poll(0):
                self.handle(self.decoder.decode(self.conn_in.recv_bytes()))
                while self.running and self.conn_in.poll(0):
                    self.handle(self.decoder.decode(self.conn_in.recv_bytes()))
                continue
            try:
                updates = self.core.step()
            except CommunicationError as exc:  # the group cannot step again: end here
                # The server fails what is in flight (503: engine unavailable) and starts a
                # new engine, which starts a new group.
                log.error("the tensor-parallel group broke (%s); stopping the engine", exc)
                raise
            except Exception as exc:  # a bug in the step: fail what is live
                log.error("the engine step failed; failing every live request", exc_info=exc)
                updates = []
                self.core.fail_all(RequestError(
                    "engine", f"the engine step failed: {type(exc).__name__}: {exc}"))
            if updates:
                self.send(StepUpdates([_wire_update(u) for u in updates]))
            for request_id, error in self.core.take_failures():
                self.send(RequestFailed.of(request_id, error))


def _wire_update(u: SeqUpdate) -> Update:
    lp = u.logprobs
    return Update(u.request_id, u.index, u.token_id, u.finish_reason, u.stop_reason,
                  u.num_cached_tokens, None if lp is None else lp.logprob,
                  None if lp is None else lp.top, u.prompt_logprobs)


def run_engine_process(config: EngineConfig, conn_in: Connection, conn_out: Connection,
                       cpu_plan: CpuPlan | None = None) -> None:
    """Child entry point: build the engine, pin its threads to ``cpu_plan`` (if any), report
    ``Ready`` or ``LoadFailed``, then loop.

    SIGINT is ignored so that a Ctrl-C in the terminal reaches only the server, which
    then shuts the engine down in order.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format="freetoken engine: %(levelname)s %(name)s: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = _Engine(config, conn_in, conn_out)
    except Exception as exc:  # noqa: BLE001 (reported to the operator, then exit)
        text = str(exc) if isinstance(exc, FreeTokenError) else f"{type(exc).__name__}: {exc}"
        conn_out.send_bytes(encoder.encode(LoadFailed(text)))
        return
    parts = engine.parts
    # The model, torch and transformers leave ~1e6 long-lived objects: out of the cyclic
    # collector's way, a full collection no longer stalls a step for a few hundred ms.
    gc.collect()
    gc.freeze()
    if cpu_plan is not None and parts.group is None:  # a group's ranks pinned themselves
        try:
            pin_engine_threads(cpu_plan)
        except OSError as exc:  # e.g. a CPU taken away meanwhile: serve unpinned
            log.warning("could not pin the engine's threads (%s); running unpinned", exc)
    engine.send(Ready(str(parts.model_dir), parts.limits.vocab_size,
                      sorted(parts.limits.eos_token_ids), parts.limits.max_model_len,
                      parts.generation_defaults))
    try:
        engine.loop()
    except (EOFError, BrokenPipeError, OSError):
        pass  # the server went away: nothing left to serve
    except CommunicationError:
        sys.exit(1)  # the supervisor starts a new engine and group
    finally:
        if parts.group is not None:
            parts.group.close()
