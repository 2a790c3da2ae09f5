"""The engine steps' wall time, kept by ``EngineCore`` and reported in ``GET /metrics``
(light: the HTTP process imports it without torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STEP_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, math.inf)
"""Upper bounds of the step-time histogram (``freetoken_engine_step_seconds``)."""


@dataclass
class StepTimes:
    """Wall time of the engine steps that ran the model, since the engine started: all of
    them as a histogram (``bucket_counts[i]``: steps that took at most
    ``STEP_BUCKETS_S[i]``), and the decode steps (every sequence of the step computed one
    token of its answer) as a sum and a count, the time the served inter-token latency
    stands on."""

    count: int = 0
    seconds: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS_S))
    decode_count: int = 0
    decode_seconds: float = 0.0

    def record(self, seconds: float, decode: bool) -> None:
        self.count += 1
        self.seconds += seconds
        for i, bound in enumerate(STEP_BUCKETS_S):
            if seconds <= bound:
                self.bucket_counts[i] += 1
        if decode:
            self.decode_count += 1
            self.decode_seconds += seconds
