"""The plugin contract (v2): one class is a plugin; a logits processor is one such class.

A plugin ships one class, named by its entry point in the ``freetoken.plugins`` group
(``my_plugin = "my_package.module:MyProcessor"``); the entry point's name is the plugin's name.

``Plugin`` (any plugin):

- ``Fields``: the request fields the plugin owns, as a ``RequestFields`` struct. Each
  attribute is one top-level request field, with its type and constraints (msgspec
  ``Meta``) and a default (``None``: not sent). The server adds them to its request types,
  so they are checked by type, named in a 400 and published in the OpenAPI schema; offline
  they are ``SamplingParams`` keywords.
- ``uses(fields)``: does a request with these fields need the plugin? Default: any field
  differs from its default. A request that does not use a plugin never reaches it.
- ``MessageFields`` / ``UsageFields``: response fields the plugin sets (``ResponseFields``
  structs); the server adds them to its chat messages and deltas / to ``usage``, and to
  the schema, without knowing their names.
- ``ChatMessageFields``: keys a chat *request* message may carry beyond ``role``,
  ``content`` and ``name`` (a ``RequestFields`` struct: an assistant's earlier tool calls);
  checked by type (a 400 naming ``messages[i].key``) and handed to the chat template with
  the message.
- ``implies(fields, params)``: request fields of *other* plugins that this request sets
  (``Implied``): a tool choice that must be a call asks the grammar plugin for the call's
  JSON schema. The owner validates them as if the client had sent them; a client that
  sent one of them too gets a 400.
- ``validate(fields, model, params)``: the checks a type cannot say (a token id within
  the vocabulary, a bound that depends on ``max_tokens``); raise ``InvalidRequest`` naming
  the field, else return the fields to keep (the same object or a normalised copy). ``params`` is the request being
  validated: core fields checked, ``params.extra`` every plugin field as sent. The core calls it once, in the process that accepts the request; the
  engine receives the validated fields as a typed message and does not call it again.
- hooks: static or class methods named ``freetoken_*`` and marked ``@hookimpl``
  (``freetoken_core.hookspecs`` lists them) for what is not a processor: prompt rewriting,
  chat template inputs, stop rules, response decoration, command-line options.

``LogitsProcessor(Plugin)`` adds per-slot state in the engine. The engine gives every
running sequence a slot in ``[0, max_num_slots)`` and owns the mapping from batch rows to
slots; a processor keeps its per-slot state in tensors preallocated on the device and
never does row bookkeeping. One instance per engine, built with a ``ProcessorContext``:

- ``prepare_request(request)`` (optional): slow per-request work (a grammar compile) that
  must not run inside a step. Return a ``concurrent.futures.Future`` (or ``None``); the
  request waits, without holding up the others, until it resolves, and its result is
  ``request.prepared`` in ``add_request``. An exception from the future fails the request
  (``InvalidRequest``: a 400 naming its field).
- ``reads_history`` (class attribute): ``True`` when the processor reads ``self.history``,
  the engine's ``TokenHistory`` of every slot's prompt + generated tokens on the device
  (``freetoken_core.history``); the engine then keeps it for the slots of the requests
  that use the processor, writes it (a slot before ``add_request``, each step's tokens
  before ``update``) and no processor keeps a copy of its own.
- ``add_request(slot, request)``: build the slot's state once (``request`` is a
  ``RequestView``: this plugin's typed ``fields``, the core ``params``, the prompt and the
  tokens drawn so far, which are not empty when a preempted sequence comes back).
- ``remove_request(slot)``: forget the slot (it may be reused for another request).
- ``prepare_step(slots)`` (optional, host): per-step host work, called after the model
  step was launched and before the logits are needed, so a device that runs
  asynchronously overlaps the two (a grammar's token mask). ``slots`` is a ``list[int]``:
  ``slots[i]`` is the slot of logits row ``i`` (rows of requests that do not use the
  processor included).
- ``apply(logits, slots)``: change the float32 ``logits`` [rows, vocab] in place for all
  rows at once; row ``i`` belongs to ``slots[i]``. Rows of slots that do not use the
  processor must come out unchanged.
- ``update(slots, sampled)`` (optional, device): fold the step's sampled tokens into the
  device state; 1-D long tensors of the rows that drew a token, **slots the processor was
  never given included** (mask by its own per-slot state). The token history already
  ends with them. No device-to-host sync.
- ``accept_tokens(slots, token_ids)`` (optional, host): the same step's tokens as Python
  ints, for host-side state (a grammar matcher). Return the slots whose request must end
  now (``finish_reason`` ``"stop"``), or ``None``.

Pipeline order (``Stage``), fixed here and nowhere else:
constraint masks (``MASK``) → additive biases (``BIAS``) → token holds (``HOLD``) →
downweighting of seen tokens (``PENALTY``) → other pre-temperature processors →
[greedy shortcut when every row is greedy] → temperature → post-temperature processors →
top-k / top-p → counter-based draw → logprobs. Processors declared ``argmax_invariant`` are skipped in all-greedy steps.
Constraint masks (``Stage.MASK``) run first of all, so the other processors see only
allowed tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:
    import torch

    from freetoken_core.history import TokenHistory
    from freetoken_core.sampling_params import SamplingParams


class Stage(enum.IntEnum):
    """Where a processor runs in the pipeline; lower runs first."""

    MASK = 5
    """Allowed-token masks (a grammar): first, so every later stage sees allowed tokens."""
    BIAS = 10
    """Additive per-token biases chosen by the client."""
    HOLD = 20
    """Tokens held back for now (end of sequence before a minimum length)."""
    PENALTY = 30
    """Downweighting of tokens already seen (in the prompt or the output)."""
    PRE_TEMPERATURE = 40
    """Any other processor on the raw logits (third-party processors usually go here)."""
    POST_TEMPERATURE = 60
    """Processors on temperature-scaled logits (probability floors)."""


@dataclass(frozen=True)
class ModelInfo:
    """What validation and processors may know about the served model."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int


class RequestFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of a plugin's ``Fields``: every attribute is a top-level request field and must
    have a default (``None`` for "not sent"). Types and ``msgspec.Meta`` constraints are
    checked when the request is decoded; the first violation is a 400 naming the field."""


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor instance is built with, in the engine process."""

    max_num_slots: int
    model: ModelInfo
    device: torch.device
    tokenizer: Any = None
    """The model's Hugging Face fast tokenizer (``None`` in unit tests that need none)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The parsed ``freetoken serve`` / ``generate`` options (``vars(args)``), including the
    ones plugins added with ``freetoken_add_cli_options``; empty offline."""
    hooks: Any = None
    """The plugin manager's hook caller (``pm.hook``): a processor may ask other plugins
    (``freetoken_answer_start``) without importing them. ``None`` in unit tests."""
    history: TokenHistory | None = None
    """Every slot's tokens (prompt + generated) on the device, kept by the engine when an
    enabled processor sets ``reads_history`` (``freetoken_core.history``); ``None``
    otherwise. ``freetoken_core.testing`` builds one for a processor under test."""


@dataclass(frozen=True)
class RequestView:
    """One sequence as a processor sees it when it is added.

    ``fields`` is this processor's validated ``Fields``; ``params`` the core sampling
    parameters (read-only); ``output_token_ids`` is empty for a new sequence and holds the
    tokens drawn so far when a preempted one comes back; ``prepared`` is the result of
    ``prepare_request`` (``None`` if it returned none); ``is_chat`` says whether the
    prompt came from the chat route (a chat template)."""

    request_id: str
    index: int
    fields: Any
    params: SamplingParams
    prompt_token_ids: SequenceABC[int]
    output_token_ids: SequenceABC[int]
    is_chat: bool = False
    prepared: Any = None


@dataclass
class StopView:
    """One sequence as ``freetoken_check_stop`` sees it. ``fields`` is the plugin's
    validated ``Fields`` for the request; ``output_token_ids`` is a read-only sequence of
    the generated tokens (the engine passes a view: indexing from the end is cheap, slicing
    copies)."""

    params: SamplingParams
    num_output_tokens: int
    output_token_ids: SequenceABC[int]
    fields: Any = None


@dataclass(frozen=True)
class PromptView:
    """One completions prompt as ``freetoken_rewrite_prompt`` sees it: the prompt (text or
    token ids), the request's validated parameters (``params.fields``: the plugins' typed
    fields) and the model's tokenizer."""

    prompt: str | list[int]
    params: SamplingParams
    tokenizer: Any


@dataclass(frozen=True)
class AnswerStart:
    """Where a sequence's answer begins (``freetoken_answer_start``): after the first
    ``close_token_id`` the sequence draws. ``inside`` is true when the prompt left the
    preamble open (the answer starts only after ``close_token_id``); otherwise the answer
    starts at once, unless the first drawn token is ``open_token_id`` (the model opens a
    preamble itself)."""

    close_token_id: int
    inside: bool
    open_token_id: int | None = None


@dataclass(frozen=True)
class Implied:
    """Request fields one plugin sets for others (``Plugin.implies``): ``fields`` maps each
    field to its value, as a client would send it; ``by`` is the request field of the
    implying plugin that a 400 names (a conflict, a disabled owner)."""

    by: str
    fields: dict[str, Any]


@dataclass
class ChatView:
    """A chat request about to be rendered (``freetoken_chat_template``).

    ``messages`` are the dicts the template receives (``role``, ``content``, ``name`` and
    the ``ChatMessageFields`` keys the client sent), and ``variables`` the extra template
    variables (``chat_template_kwargs``); change both in place. ``template`` is the chat
    template's source (``""`` when the model has none), ``tokenizer`` the model's.
    ``params`` is the validated request (``params.fields``: the plugins it uses); ``None``
    on ``/tokenize``, which renders messages without sampling parameters."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]
    template: str
    tokenizer: Any
    params: SamplingParams | None


class ResponseFields(msgspec.Struct, kw_only=True):
    """Base of a plugin's ``MessageFields`` / ``UsageFields``: response fields the server
    adds to its chat messages and stream deltas / to ``usage``, and to the OpenAPI schema.
    Type every field ``T | msgspec.UnsetType = msgspec.UNSET``: it is left out of the JSON
    until the plugin sets it (in ``freetoken_decorate_response``)."""


@dataclass
class ChoiceView:
    """One choice of a response or stream chunk, as ``freetoken_decorate_response`` sees
    it. ``text`` is the choice's text (chat: the message or delta ``content``; ``None`` in a
    chunk that has none, or a message whose content a plugin set to ``null``): assign it
    to change what is sent. ``finish_reason`` is set on the choice's last chunk (and on a
    whole response); assign it to report another reason (a call was made). ``message`` is
    the chat message or delta, on which a plugin sets its ``MessageFields`` (``None`` on
    completions)."""

    index: int
    text: str | None
    finish_reason: str | None
    message: Any


@dataclass
class ResponseView:
    """A response or stream chunk about to be sent (``freetoken_decorate_response``).

    ``route`` is ``"chat"`` or ``"completions"``; ``is_chunk`` is true in a stream;
    ``usage`` is where a plugin sets its ``UsageFields`` (``None`` in chunks without
    usage). ``params``, ``prompt_token_ids`` (per prompt), ``tokenizer`` and
    ``token_ids(i)`` (the tokens choice ``i`` generated so far) describe the request;
    choice ``i`` belongs to prompt ``i // params.n``. ``plugin_state`` keeps per-request
    state across the chunks of a stream: use your plugin's name as the key."""

    route: str
    is_chunk: bool
    choices: list[ChoiceView]
    usage: Any
    params: SamplingParams
    prompt_token_ids: list[list[int]]
    tokenizer: Any
    token_ids: Callable[[int], list[int]]
    plugin_state: dict[str, Any]


class Plugin:
    """Base class of every plugin; see the module docstring for the contract."""

    Fields: ClassVar[type[RequestFields] | None] = None
    MessageFields: ClassVar[type[ResponseFields] | None] = None
    """Fields added to every chat message and stream delta (say, a message's thinking)."""
    ChatMessageFields: ClassVar[type[RequestFields] | None] = None
    """Keys a chat request message may carry (say, an assistant's earlier tool calls)."""
    UsageFields: ClassVar[type[ResponseFields] | None] = None
    """Fields added to ``usage`` (say, a count of some kind of output token)."""
    name: ClassVar[str] = ""
    """The plugin's name; the core sets it to the entry point's name when it is empty."""
    routes: ClassVar[frozenset[str]] = frozenset({"chat", "completions"})
    """The server routes whose requests may carry ``Fields`` (a field sent to another
    route is a 400 naming it); offline requests may always carry them."""
    request_rules: ClassVar[tuple[dict[str, Any], ...]] = ()
    """JSON Schema subschemas a request body of those routes must also satisfy: the rules
    between fields that ``validate`` checks and the field types cannot say (``if``/``then``,
    ``not``: "field a needs field b"). The server's OpenAPI document adds them to the
    request schemas (``allOf``); they document, ``validate`` still decides."""

    @classmethod
    def uses(cls, fields: Any) -> bool:
        if cls.Fields is None or fields is None:
            return False
        return any(getattr(fields, f.name) != _default_of(f)
                   for f in msgspec.structs.fields(fields))

    @classmethod
    def validate(cls, fields: Any, model: ModelInfo, params: SamplingParams) -> Any:
        """Raise ``InvalidRequest`` for a value no type can refuse; return the fields."""
        return fields

    @classmethod
    def implies(cls, fields: Any, params: SamplingParams) -> Implied | None:
        """Request fields of other plugins that a request with these (validated) fields
        sets; ``None``: none."""
        return None


class LogitsProcessor(Plugin):
    """Base class of every logits processor; see the module docstring for the contract."""

    stage: ClassVar[Stage] = Stage.PRE_TEMPERATURE
    argmax_invariant: ClassVar[bool] = False
    reads_history: ClassVar[bool] = False
    """``True``: the processor reads ``self.history`` (each slot's tokens on the device),
    so the engine keeps it for the slots of the requests that use the processor."""

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx
        self.max_num_slots = ctx.max_num_slots
        self.model = ctx.model
        self.device = ctx.device
        if self.reads_history and ctx.history is None:
            raise ValueError(f"{type(self).__name__} reads the token history, which this "
                             "ProcessorContext lacks (build processors with a "
                             "ProcessorPipeline or freetoken_core.testing.Harness)")
        self.history: TokenHistory = ctx.history  # type: ignore[assignment] (None: unread)

    def prepare_request(self, request: RequestView) -> Future[Any] | None:
        return None

    def add_request(self, slot: int, request: RequestView) -> None:
        raise NotImplementedError

    def remove_request(self, slot: int) -> None:
        raise NotImplementedError

    def prepare_step(self, slots: list[int]) -> None:
        """Host-side work before ``apply``; ``slots[i]`` is row ``i``'s slot (every row).
        Most processors have none."""

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        raise NotImplementedError

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Fold the drawn tokens in; ``slots`` covers every row that drew, slots never
        given to this processor included. Most processors keep no per-step device state
        (the token history is the engine's); the default does nothing."""

    def accept_tokens(self, slots: list[int], token_ids: list[int]) -> Iterable[int] | None:
        """Host-side per-step state; most processors have none."""
        return None


def _default_of(info: msgspec.structs.FieldInfo) -> Any:
    if info.default_factory is not msgspec.NODEFAULT:
        return info.default_factory()
    return info.default


def has_method(cls: type, name: str) -> bool:
    """Whether ``cls`` overrides ``LogitsProcessor.name`` (the pipeline skips the default
    no-op methods entirely)."""
    return getattr(cls, name) is not getattr(LogitsProcessor, name)


def check_plugin_class(cls: object) -> None:
    """Reject a plugin class that breaks the contract, at start-up."""
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise TypeError(f"{cls!r} is not a freetoken_core.Plugin subclass")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    for attr in ("Fields", "ChatMessageFields"):
        value = getattr(cls, attr)
        if value is None:
            continue
        if not (isinstance(value, type) and issubclass(value, RequestFields)):
            raise TypeError(f"{cls.__name__}.{attr} must subclass freetoken_core.RequestFields")
        missing = [f.name for f in msgspec.structs.fields(value) if f.required]
        if missing:
            raise TypeError(f"{cls.__name__}.{attr}: {', '.join(missing)} need a default")
    for attr in ("MessageFields", "UsageFields"):
        value = getattr(cls, attr)
        if value is not None and not (isinstance(value, type)
                                      and issubclass(value, ResponseFields)):
            raise TypeError(f"{cls.__name__}.{attr} must subclass freetoken_core.ResponseFields")
    if issubclass(cls, LogitsProcessor) and not isinstance(cls.stage, Stage):
        raise TypeError(f"{cls.__name__}.stage must be a freetoken_core.processors.Stage")
