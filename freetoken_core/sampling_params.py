"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from freetoken_core.errors import InvalidRequest

MAX_LOGPROBS = 20


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(param, message)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(init=False)
class SamplingParams:
    """What one request asks of the sampler, in the shape vLLM users know.

    Takes keyword arguments only. The core fields below are checked on construction; a
    bad value raises ``InvalidRequest`` naming the field, which the server turns into an
    HTTP 400. Any other keyword (``repetition_penalty=1.3``, ``logit_bias={42: 5.0}``, …)
    is a plugin field: it is kept in ``extra``, readable as an attribute, and checked by
    the plugin that owns it when the request reaches an engine (a field that no enabled
    plugin owns is refused there). ``temperature == 0`` means greedy.
    ``seed`` makes sampling reproducible whatever else shares the batch; without it each
    request draws a fresh seed. ``logprobs`` is the number of top alternatives to return
    beside the sampled token's log-probability (``None``: no logprobs).
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
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **kwargs: Any) -> None:
        for f in fields(self):
            if f.name == "extra":
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            else:
                value = f.default_factory() if f.default is MISSING else f.default
            setattr(self, f.name, value)
        self.extra = {k: v for k, v in kwargs.items() if v is not None}
        self.__post_init__()

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
        _require(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "n must be in [1, 128]")
        _require(
            _is_finite_number(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature", "temperature must be a finite number in [0, 2]",
        )
        _require(
            _is_finite_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p", "top_p must be a finite number in (0, 1]",
        )
        _require(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k", "top_k must be -1 (disabled) or >= 1",
        )
        _require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", "max_tokens must be an integer >= 1",
        )
        _require(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            "seed", "seed must be an integer",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop", "stop must be a non-empty string or a list of non-empty strings",
        )
        _require(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
