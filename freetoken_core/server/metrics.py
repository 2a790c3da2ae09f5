"""``GET /metrics``: the server's counters and the engine's load in Prometheus text format
(exposition format 0.0.4).

``ServerMetrics.record`` runs once per generation request, in the server process, when
its run ends; ``render`` adds a snapshot of the engine's load taken between two steps.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from freetoken_core.engine.process import Stats
from freetoken_core.engine.step_times import STEP_BUCKETS_S

if TYPE_CHECKING:
    from freetoken_core.server.generation import Generation

MEDIA_TYPE = "text/plain; version=0.0.4"
"""The media type the route hands Litestar, which appends ``; charset=utf-8`` to any
``text/*`` type (so the charset must not be in it too)."""
CONTENT_TYPE = f"{MEDIA_TYPE}; charset=utf-8"
"""The ``Content-Type`` header ``GET /metrics`` sends."""
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf)


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class ServerMetrics:
    """Counters since start-up. Touched only on the event loop's thread (no lock)."""

    def __init__(self) -> None:
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finish_reasons: Counter[str] = Counter()
        self.latency_counts = [0] * len(LATENCY_BUCKETS_S)
        self.latency_sum = 0.0
        self.failures: Counter[tuple[str, str]] = Counter()

    def record(self, gen: Generation) -> None:
        """Count one ended request: its tokens, each choice's finish reason (``abort`` for
        a choice left unfinished, ``error`` for every choice when the engine failed), and
        its end-to-end time."""
        usage = gen.usage()
        self.num_requests += 1
        self.num_prompt_tokens += usage.prompt_tokens
        self.num_generation_tokens += usage.completion_tokens
        for reason, _ in gen.finishes():
            self.finish_reasons["error" if gen.error is not None else reason or "abort"] += 1
        elapsed = time.monotonic() - gen.started
        self.latency_sum += elapsed
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if elapsed <= bound:
                self.latency_counts[i] += 1

    def record_failure(self, stage: str | None, plugin: str | None) -> None:
        """Count one request failed inside FreeToken (HTTP 500): a plugin raised, a model
        step failed or a row's logits were not finite."""
        self.failures[(stage or "engine", plugin or "")] += 1

    def render(self, stats: Stats | None, num_engine_restarts: int = 0) -> str:
        """The exposition text: engine gauges from ``stats`` (``None`` while the engine is
        down: only ``engine_up`` 0), then the counters."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP freetoken_{name} {help_}")
            lines.append(f"# TYPE freetoken_{name} {kind}")
            lines.extend(f"freetoken_{name} {_number(v)}" for name, v in samples)

        metric("engine_up", "gauge", "1 while the engine process serves requests, else 0.",
               [("engine_up", int(stats is not None))])
        metric("engine_restarts", "counter", "Engine processes started after one died.",
               [("engine_restarts_total", num_engine_restarts)])
        metric("request_failures", "counter",
               "Requests failed inside FreeToken (HTTP 500), by stage and plugin.",
               [(f'request_failures_total{{stage="{stage}",plugin="{plugin}"}}', count)
                for (stage, plugin), count in sorted(self.failures.items())])
        if stats is not None:
            self._render_engine(stats, metric)
        metric("requests", "counter", "Generation requests ended (finished or not).",
               [("requests_total", self.num_requests)])
        metric("prompt_tokens", "counter", "Prompt tokens of ended requests.",
               [("prompt_tokens_total", self.num_prompt_tokens)])
        metric("generation_tokens", "counter", "Generated tokens of ended requests.",
               [("generation_tokens_total", self.num_generation_tokens)])
        metric("choices_finished", "counter",
               "Choices (prompt x n) ended, by finish reason (stop, length, abort, error).",
               [(f'choices_finished_total{{finish_reason="{reason}"}}', count)
                for reason, count in sorted(self.finish_reasons.items())])
        buckets = [(f'e2e_request_latency_seconds_bucket{{le="{_number(bound)}"}}', count)
                   for bound, count in zip(LATENCY_BUCKETS_S, self.latency_counts)]
        metric("e2e_request_latency_seconds", "histogram",
               "Time from a generation request's submission to its end.",
               [*buckets, ("e2e_request_latency_seconds_sum", self.latency_sum),
                ("e2e_request_latency_seconds_count", self.num_requests)])
        return "\n".join(lines) + "\n"

    @staticmethod
    def _render_engine(stats: Stats, metric: Callable[..., None]) -> None:
        usage = stats.num_used_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
        gauges = [
            ("num_seqs_running", "Sequences (one per choice) in the running batch.",
             stats.num_running),
            ("num_seqs_waiting", "Sequences (one per choice) waiting to be scheduled.",
             stats.num_waiting),
            ("num_requests_live", "Engine requests (one per prompt) not yet finished.",
             stats.num_requests),
            ("kv_blocks_used", "KV-cache blocks held by sequences.", stats.num_used_kv_blocks),
            ("kv_blocks_total", "KV-cache blocks in the pool.", stats.num_kv_blocks),
            ("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).", usage),
        ]
        for name, help_, value in gauges:
            metric(name, "gauge", help_, [(name, value)])
        metric("engine_requests_aborted", "counter",
               "Engine requests aborted while live (since the engine process started).",
               [("engine_requests_aborted_total", stats.num_aborted_requests)])
        if len(stats.step_bucket_counts) == len(STEP_BUCKETS_S):
            steps = [(f'engine_step_seconds_bucket{{le="{_number(bound)}"}}', count)
                     for bound, count in zip(STEP_BUCKETS_S, stats.step_bucket_counts)]
            metric("engine_step_seconds", "histogram",
                   "Wall time of the engine steps that ran the model (since the engine "
                   "process started).",
                   [*steps, ("engine_step_seconds_sum", stats.step_seconds),
                    ("engine_step_seconds_count", stats.num_steps)])
        metric("engine_decode_step_seconds", "summary",
               "Wall time of the decode steps (every sequence of the step computed one "
               "token of its answer): what the inter-token latency stands on.",
               [("engine_decode_step_seconds_sum", stats.decode_step_seconds),
                ("engine_decode_step_seconds_count", stats.num_decode_steps)])
