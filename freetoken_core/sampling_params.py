"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from freetoken_core.errors import InvalidRequest

if TYPE_CHECKING:
    from freetoken_core.processors import ModelInfo

MAX_LOGPROBS = 20
MAX_N = 128
"""Most choices one ``SamplingParams`` may ask for (the server allows fewer: ``MAX_N``
in ``server/protocol.py``)."""
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
"""``seed`` must lie in ``[INT64_MIN, INT64_MAX]`` (OpenAI's and vLLM's range; the engine
keeps seeds as int64), ``top_k`` at most ``INT64_MAX`` before the model's vocabulary bounds it."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (``temperature`` becomes ``0.0``), as in vLLM:
dividing logits by a smaller temperature could overflow float32 (and below float32's
range the temperature would round to zero and be taken as ``1``)."""
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
"""The core fields a server-wide default may set for requests that leave them unset
(``--generation-config``); the other core fields shape one request's answer (``n``,
``logprobs``, ``cache_salt``, …) and have no default but their own."""


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(param, message)


def finite_float(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool) whose float is finite;
    ``None`` otherwise, including for an integer too large for a float (``10**400``).
    Plugins use it to check their float fields without risking ``OverflowError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(init=False)
class SamplingParams:
    """What one request asks of the sampler, in the shape vLLM users know.

    Takes keyword arguments only. The core fields below are checked on construction; a
    bad value raises ``InvalidRequest`` naming the field, which the server turns into an
    HTTP 400. Any other keyword (``my_penalty=1.3``, ``my_bias={42: 5.0}``, …)
    is a plugin field: it is kept in ``extra``, readable as an attribute, and checked by
    the plugin that owns it when the request reaches an engine (a field that no enabled
    plugin owns is refused there). ``temperature == 0`` means greedy, and so does any
    temperature below ``GREEDY_TEMPERATURE``, which construction turns into ``0.0``.
    ``seed`` (an int64) makes sampling reproducible whatever else shares the batch; without
    it each request draws a fresh seed. ``logprobs`` is the number of top alternatives to
    return beside the sampled token's log-probability (``None``: no logprobs).
    ``verify(model)`` checks what depends on the model (``top_k`` and ``logprobs`` against
    the vocabulary); the process that accepts a request calls it.
    After validation (``PluginManager.validate``) ``fields`` maps the name of each plugin
    the request uses to its typed, validated ``Fields``; that is what processors read.
    ``cache_salt`` (a non-empty string; the server bounds its length with
    ``--max-cache-salt-chars``) keys the prefix cache: requests share cached prompt blocks only when their salts are
    equal or both absent.

    Set or unset: a core field is *set* when it is passed as a keyword, whatever its value
    (``SamplingParams(temperature=1.0)`` sets the temperature; ``SamplingParams()`` leaves
    it unset and reads the neutral class default, ``1.0``); a plugin field is set when it is
    present in ``extra`` (a ``None`` value counts as absent). ``is_set(name)`` tells, and
    ``with_defaults(defaults)`` fills what is unset (the server's generation defaults):
    whatever the engine reads is always a concrete value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **kwargs: Any) -> None:
        given = []
        for f in fields(self):
            if f.name in ("extra", "fields"):
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
                given.append(f.name)
            else:
                value = f.default_factory() if f.default is MISSING else f.default
            setattr(self, f.name, value)
        self.extra = {k: v for k, v in kwargs.items() if v is not None}
        self.fields = {}
        self._given = frozenset(given)
        self.__post_init__()

    @classmethod
    def trusted(cls, core: dict[str, Any], plugin_fields: dict[str, Any]) -> SamplingParams:
        """Parameters validated by another process (the engine side of ``freetoken
        serve``): ``core`` as ``core_fields()`` gave them, ``plugin_fields`` the typed
        ``fields``. Nothing is checked again."""
        params = cls.__new__(cls)
        params.__dict__.update(core)
        params.extra = {}
        params.fields = dict(plugin_fields)
        params._given = frozenset(core)
        return params

    def is_set(self, name: str) -> bool:
        """Whether the request set field ``name`` (a core field passed as a keyword, or a
        plugin field present in ``extra``); see the class docstring."""
        if name in self.__dict__.get("_given", ()):
            return True
        return name not in _CORE_FIELDS and name in self.extra

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These parameters with each field of ``defaults`` (name → value: a core field or a
        plugin field) that is unset here taking its value from there, validated as on
        construction (``InvalidRequest`` naming the field). Returns ``self`` when nothing
        applies, else a new object in which the defaults count as set."""
        applied = {name: value for name, value in defaults.items() if not self.is_set(name)}
        if not applied:
            return self
        given = self.__dict__.get("_given", frozenset())
        return SamplingParams(**{name: getattr(self, name) for name in given},
                              **self.extra, **applied)

    def core_fields(self) -> dict[str, Any]:
        """The core fields (no plugin field) as plain values, for ``trusted``."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("extra", "fields")}

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not core fields: plugin fields.
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(f"SamplingParams has no field {name!r}")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        _require(isinstance(self.stop, (list, tuple)), "stop",
                 "stop must be a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop)
        _require(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}]")
        temperature = finite_float(self.temperature)
        _require(
            temperature is not None and 0.0 <= temperature <= 2.0,
            "temperature", "temperature must be a finite number in [0, 2]",
        )
        top_p = finite_float(self.top_p)
        _require(
            top_p is not None and 0.0 < top_p <= 1.0,
            "top_p", "top_p must be a finite number in (0, 1]",
        )
        _require(
            _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX),
            "top_k", "top_k must be -1 (disabled) or an integer >= 1 (at most the vocabulary "
                     "size)",
        )
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
            "max_tokens", "max_tokens must be an integer >= 0 (0: only compute the prompt)",
        )
        _require(
            self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
            "seed", f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}] (int64)",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop", "stop must be a non-empty string or a list of non-empty strings",
        )
        _require(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
        )
        _require(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
        )
        _require(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
            "cache_salt", "cache_salt must be a non-empty string",
        )
        if temperature < GREEDY_TEMPERATURE:  # checked above: a finite float
            self.temperature = 0.0

    def verify(self, model: ModelInfo) -> None:
        """Raise ``InvalidRequest`` for a core field the served model cannot honour:
        ``top_k`` above the vocabulary size, or more ``logprobs`` or ``prompt_logprobs`` than
        it has tokens."""
        vocab = model.vocab_size
        _require(self.top_k <= vocab, "top_k",
                 f"top_k must be -1 (disabled) or in [1, {vocab}] (the vocabulary size)")
        _require(self.logprobs is None or self.logprobs <= vocab, "logprobs",
                 f"logprobs must be at most {vocab} (the vocabulary size)")
        _require(self.prompt_logprobs is None or self.prompt_logprobs <= vocab,
                 "prompt_logprobs",
                 f"prompt_logprobs must be at most {vocab} (the vocabulary size)")

    @property
    def is_greedy(self) -> bool:
        """Greedy (argmax) sampling: ``temperature`` below ``GREEDY_TEMPERATURE``."""
        return self.temperature < GREEDY_TEMPERATURE


_CORE_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"extra", "fields"}
