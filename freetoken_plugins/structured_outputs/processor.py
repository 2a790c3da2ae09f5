"""The structured_outputs plugin: constrain the answer to a JSON schema, regex, choice or
grammar, as one logits processor.

Request fields (both routes): OpenAI's ``response_format`` and vLLM's ``structured_outputs``
(``constraints.py`` says what each may hold; one constraint per request, a malformed one is
a 400 naming the exact field). ``{"type": "text"}`` asks for nothing and costs nothing.

How a request goes, read top to bottom:

1. ``validate`` (once, in the process that accepts the request) parses the fields into a
   ``Constraint``.
2. ``prepare_request`` (engine process) hands the constraint to a ``GrammarCompiler``:
   compiled on worker threads, cached by constraint, so identical schemas compile once.
   The request waits outside the scheduler until its grammar is ready, and the others go
   on; an invalid grammar, or a compile longer than ``--structured-outputs-compile-timeout``
   seconds, fails it with a 400 naming the field.
3. ``add_request`` opens one matcher per sequence (``n`` sequences, ``n`` matchers) and asks
   the other plugins where the answer starts (``freetoken_answer_start``: with the reasoning
   plugin, the text up to ``</think>`` is free and only the answer is constrained). A
   preempted sequence replays its tokens into a fresh matcher.
4. ``prepare_step`` (host, each step, while the device computes the logits) writes each
   constrained row's allowed tokens into a bitmask: one ``fill_bitmask`` per row.
5. ``apply`` sets the disallowed logits to ``-inf``: torch on CPU, a Triton kernel on CUDA
   (``mask.py``; the two are cross-tested). It runs first in the pipeline (``Stage.MASK``).
6. ``accept_tokens`` (host) advances each matcher past the drawn token; when the grammar
   is complete and nothing but EOS may follow, the sequence ends at once (``finish_reason``
   ``stop``; with ``ignore_eos`` it runs on to ``max_tokens``).

Guarantees (``backends.py``): special tokens never appear inside constrained text; EOS is
allowed exactly when the grammar accepts; a row is never all ``-inf``. A sequence cut by
``max_tokens`` ends with ``finish_reason`` ``length`` and its text may not parse.

Schemas mean what they say: by default an object schema that declares ``properties`` and
says nothing of ``additionalProperties`` takes no other key (vLLM's xgrammar default and
OpenAI's strict mode); ``--structured-outputs-allow-additional-properties`` reads such
schemas literally instead, and a request overrides either way with
``structured_outputs.disable_additional_properties`` (``json_schema.strict: true`` always
closes). Whitespace between JSON tokens is bounded (``constraints.MAX_WHITESPACE``).

Options (``freetoken serve`` / ``generate``): ``--structured-outputs-backend``
(``llguidance``, the default, or ``xgrammar``), ``--structured-outputs-compile-timeout``
(10 s), ``--structured-outputs-compile-threads`` (2), ``--structured-outputs-cache-entries``
(256), ``--structured-outputs-allow-additional-properties`` (off).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.lazy import lazy_import
from freetoken_core.processors import (
    AnswerStart,
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)
from freetoken_plugins.structured_outputs.backends import (
    BACKENDS,
    CompiledGrammar,
    Matcher,
    make_backend,
    num_bitmask_words,
)
from freetoken_plugins.structured_outputs.compiler import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_NUM_THREADS,
    DEFAULT_TIMEOUT_S,
    GrammarCompiler,
)
from freetoken_plugins.structured_outputs.constraints import Constraint, parse_constraint
from freetoken_plugins.structured_outputs.mask import apply_bitmask_torch, apply_bitmask_triton

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

log = logging.getLogger("freetoken.plugins")

BENCH_PARAMS: dict[str, Any] = {"structured_outputs": {"json": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}
"""A typical request for ``freetoken bench plugin structured_outputs``."""


def constraint_of(fields: StructuredOutputs.Fields) -> tuple[Constraint | None, str]:
    """The request's constraint and the field to name when its grammar is refused."""
    constraint = parse_constraint(fields.response_format, fields.structured_outputs)
    if fields.structured_outputs is not None:
        keys = [k for k, v in fields.structured_outputs.items() if v not in (None, False)]
        return constraint, f"structured_outputs.{keys[0]}" if keys else "structured_outputs"
    if (fields.response_format or {}).get("type") == "json_schema":
        return constraint, "response_format.json_schema.schema"
    return constraint, "response_format"


def _with_timeout(inner: Future[CompiledGrammar], timeout_s: float, param: str,
                  kind: str) -> Future[CompiledGrammar]:
    """A future that ends with ``inner`` (a refusal naming ``param``), or with a 400 after
    ``timeout_s`` seconds. A cached grammar is ready at once and needs no timer."""
    outer: Future[CompiledGrammar] = Future()

    def settle(set_outcome: Any, value: Any) -> None:
        try:
            set_outcome(value)
        except InvalidStateError:
            pass  # the other outcome came first

    def on_timeout() -> None:
        settle(outer.set_exception, InvalidRequest(
            param, f"the {kind} constraint took longer than {timeout_s:g} s to compile"))

    timer = threading.Timer(timeout_s, on_timeout)
    timer.daemon = True

    def on_done(done: Future[CompiledGrammar]) -> None:
        timer.cancel()
        if done.cancelled():
            settle(outer.set_exception, InvalidRequest(param, "the compile was cancelled"))
        elif done.exception() is not None:
            exc = done.exception()
            if isinstance(exc, InvalidRequest):
                exc = InvalidRequest(param, exc.message)
            settle(outer.set_exception, exc)
        else:
            settle(outer.set_result, done.result())

    if inner.done():
        on_done(inner)
        return outer
    timer.start()
    inner.add_done_callback(on_done)
    return outer


@dataclass
class _Slot:
    """One sequence under a grammar. ``free`` while the answer has not started (inside a
    reasoning preamble); ``may_open`` on the first token, when the model may open one."""

    matcher: Matcher
    start: AnswerStart | None
    free: bool
    may_open: bool
    end_on_complete: bool


class StructuredOutputs(LogitsProcessor):
    """response_format / structured_outputs: constrain the answer to a schema, regex, choice
    or grammar."""

    class Fields(RequestFields):
        response_format: dict[str, Any] | None = None
        """OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema":
        {"name", "schema", "strict", "description"}}; undeclared keys are refused by
        default, always with strict: true."""
        structured_outputs: dict[str, Any] | None = None
        """vLLM's: exactly one of {"json", "regex", "choice", "grammar", "json_object"}, with
        json: "disable_any_whitespace" (no whitespace between tokens) and
        "disable_additional_properties" (true: an object schema with properties and no
        additionalProperties takes no other key, the server's default; false: it takes
        any)."""

    stage = Stage.MASK
    request_rules = (
        {"not": {"required": ["response_format", "structured_outputs"],
                 "properties": {"response_format": {
                     "type": "object", "properties": {"type": {"not": {"const": "text"}}}},
                     "structured_outputs": {"type": "object"}}},
         "description": "response_format (other than text) and structured_outputs exclude "
                        "each other"},
        {"properties": {"response_format": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
            # json_schema is read (and checked) only under type json_schema.
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {
                "type": "object", "required": ["name", "schema"],
                "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                               "schema": {"type": "object"},
                               "strict": {"type": ["boolean", "null"]},
                               "description": {"type": ["string", "null"]}}}}}}]}},
         "description": "response_format's shape"},
    )

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        text_only = (fields.response_format is None
                     or fields.response_format.get("type") == "text")
        return fields.structured_outputs is not None or not text_only

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        constraint_of(fields)  # a 400 naming the field when malformed
        return fields

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        self.timeout_s = float(options.get("structured_outputs_compile_timeout")
                               or DEFAULT_TIMEOUT_S)
        self.allow_additional_properties = bool(
            options.get("structured_outputs_allow_additional_properties"))
        self.backend = make_backend(
            options.get("structured_outputs_backend") or BACKENDS[0], ctx.tokenizer,
            ctx.model.vocab_size, sorted(ctx.model.eos_token_ids))
        self.compiler = GrammarCompiler(
            self.backend,
            int(options.get("structured_outputs_compile_threads") or DEFAULT_NUM_THREADS),
            self.timeout_s,
            int(options.get("structured_outputs_cache_entries") or DEFAULT_CACHE_ENTRIES))
        words = num_bitmask_words(ctx.model.vocab_size)
        self.bitmask = torch.zeros((ctx.max_num_slots, words), dtype=torch.int32)
        if ctx.device.type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
        self.slots: dict[int, _Slot] = {}
        self._step_slots: list[int] = []
        self._step_rows: list[int] = []

    # -- per request -------------------------------------------------------------------

    def prepare_request(self, request: RequestView) -> Future[CompiledGrammar]:
        constraint, param = constraint_of(request.fields)
        assert constraint is not None  # uses() said so
        if constraint.kind == "json" and constraint.additional_properties is None:
            constraint = dataclasses.replace(
                constraint, additional_properties=self.allow_additional_properties)
        return _with_timeout(self.compiler.submit(constraint), self.timeout_s, param,
                             constraint.kind)

    def add_request(self, slot: int, request: RequestView) -> None:
        hooks = self.ctx.hooks
        start = None if hooks is None else hooks.freetoken_answer_start(
            request=request, tokenizer=self.ctx.tokenizer)
        state = _Slot(self.backend.matcher(request.prepared), start,
                      free=start is not None and start.inside,
                      may_open=start is not None and not start.inside
                      and start.open_token_id is not None,
                      end_on_complete=not request.params.ignore_eos)
        for token in request.output_token_ids:  # a preempted sequence comes back
            self._advance(state, token)
        self.slots[slot] = state

    def remove_request(self, slot: int) -> None:
        self.slots.pop(slot, None)

    # -- per step --------------------------------------------------------------------

    def prepare_step(self, slots: list[int]) -> None:
        """Fill the bitmask rows of the constrained slots among ``slots`` (row order)."""
        self._step_slots, self._step_rows = [], []
        for row, slot in enumerate(slots):
            state = self.slots.get(slot)
            if state is None or state.free:
                continue
            state.matcher.fill_bitmask(self.bitmask, slot)
            if state.may_open and state.start is not None:
                token = state.start.open_token_id
                assert token is not None
                self.bitmask[slot, token // 32] |= _bit(token % 32)
            self._step_slots.append(slot)
            self._step_rows.append(row)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        if not self._step_rows:
            return
        rows = torch.tensor(self._step_rows, dtype=torch.long)
        bitmask = self.bitmask[torch.tensor(self._step_slots, dtype=torch.long)]
        if logits.is_cuda:
            apply_bitmask_triton(logits, bitmask.to(logits.device, non_blocking=True),
                                 rows.to(logits.device, non_blocking=True))
        else:
            apply_bitmask_torch(logits, bitmask, rows)

    def accept_tokens(self, slots: list[int], token_ids: list[int]) -> list[int]:
        ended = []
        for slot, token in zip(slots, token_ids):
            state = self.slots.get(slot)
            if state is not None and self._advance(state, token):
                ended.append(slot)
        return ended

    def _advance(self, state: _Slot, token: int) -> bool:
        """Move ``state`` past ``token``; whether the sequence must end now."""
        start = state.start
        if state.may_open:
            state.may_open = False
            if start is not None and token == start.open_token_id:
                state.free = True  # the model opened its preamble: the answer comes later
                return False
        if state.free:
            state.free = start is None or token != start.close_token_id
            return False
        matcher = state.matcher
        if not matcher.accept(token):
            if matcher.is_terminated():
                return False  # only EOS may follow (drawn again under ignore_eos)
            # The mask allowed only what the matcher accepts: a backend inconsistency.
            log.error("structured_outputs: token %d was drawn outside the grammar's mask; "
                      "the sequence ends here", token)
            return True
        return state.end_on_complete and matcher.is_terminated() and matcher.error() is None

    # -- options -----------------------------------------------------------------------

    @staticmethod
    @hookimpl
    def freetoken_add_cli_options(parser: argparse._ArgumentGroup) -> None:
        parser.add_argument("--structured-outputs-backend", choices=BACKENDS,
                            default=BACKENDS[0],
                            help=f"grammar engine (default: {BACKENDS[0]})")
        parser.add_argument("--structured-outputs-compile-timeout", type=float,
                            default=DEFAULT_TIMEOUT_S, metavar="S",
                            help="a grammar that takes longer to compile is a 400 "
                                 f"(default: {DEFAULT_TIMEOUT_S:g})")
        parser.add_argument("--structured-outputs-compile-threads", type=int,
                            default=DEFAULT_NUM_THREADS, metavar="N",
                            help=f"grammars compiled at once (default: {DEFAULT_NUM_THREADS})")
        parser.add_argument("--structured-outputs-allow-additional-properties",
                            action="store_true",
                            help="read a JSON schema's objects literally: one with "
                                 "properties and no additionalProperties takes other keys "
                                 "too (default: it takes only its declared keys; a request "
                                 "may say either with structured_outputs."
                                 "disable_additional_properties)")
        parser.add_argument("--structured-outputs-cache-entries", type=int,
                            default=DEFAULT_CACHE_ENTRIES, metavar="N",
                            help=f"compiled grammars kept (default: {DEFAULT_CACHE_ENTRIES})")


def _bit(index: int) -> int:
    """The int32 with bit ``index`` set (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index
