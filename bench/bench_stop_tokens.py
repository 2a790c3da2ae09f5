"""The cost of the stop_tokens plugin: its stop hook, and the engine step around it
(pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_stop_tokens.py --benchmark-only -q

stop_tokens is no logits processor: its cost is ``freetoken_check_stop``, which the engine
calls once per step (through pluggy) with the rows whose request has ``stop_token_ids``.
Group "hook": that call for 64 rows using ``BENCH_PARAMS`` (four ids), when no row stops
and when every row stops. Group "sampler step": batch 64, vocabulary 151,936, 3,000
history tokens per row, temperature 0.8, top_p 0.95, three cases as in the other plugin
benches: ``plain`` (no plugin), ``idle`` (enabled, no row uses it), ``active`` (every row
has ``stop_token_ids``: the sampler step plus the hook); compare their means in the table.
``freetoken bench plugin stop_tokens`` prints the same three as ratios.
"""

from __future__ import annotations

import random

import pytest
from plugin_cases import CASES, SHAPE, sampler_step

from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, StopView
from freetoken_core.sampling_params import SamplingParams
from freetoken_plugins.stop_tokens import BENCH_PARAMS

MODEL = ModelInfo(SHAPE.vocab, frozenset({2}), 8192)


@pytest.mark.parametrize("case", CASES)
def test_sampler_step(benchmark, case: str) -> None:
    sampler_step(benchmark, "stop_tokens", case)


@pytest.mark.parametrize("stopping", [False, True], ids=["no_row_stops", "every_row_stops"])
def test_check_stop_hook(benchmark, stopping: bool) -> None:
    manager = PluginManager(plugins="stop_tokens")
    hook = manager.pm.hook.freetoken_check_stop
    params = SamplingParams(**BENCH_PARAMS)
    manager.validate(params, MODEL)
    rng = random.Random(0)
    views = [StopView(params, 3000, [rng.randrange(7, SHAPE.vocab) for _ in range(3000)],
                      params.fields["stop_tokens"]) for _ in range(SHAPE.batch)]
    ids = BENCH_PARAMS["stop_token_ids"]
    tokens = [ids[i % len(ids)] if stopping else rng.randrange(7, SHAPE.vocab)
              for i in range(SHAPE.batch)]
    benchmark.group = f"stop_tokens freetoken_check_stop hook, {SHAPE.batch} rows"
    results = benchmark(hook, sequences=views, token_ids=tokens)
    stops = {row: token for result in results for row, token in (result or {}).items()}
    assert len(stops) == (SHAPE.batch if stopping else 0)
