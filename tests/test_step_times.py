"""EngineCore.step_times: every step that ran the model, and the decode steps apart."""

from __future__ import annotations

from pathlib import Path

from freetoken_core import LLM, SamplingParams
from freetoken_core.engine.step_times import STEP_BUCKETS_S, StepTimes


def test_record_fills_the_histogram_and_the_decode_sum() -> None:
    times = StepTimes()
    times.record(0.004, decode=True)
    times.record(0.03, decode=False)
    times.record(5.0, decode=True)
    assert times.count == 3 and times.decode_count == 2
    assert abs(times.seconds - 5.034) < 1e-9 and abs(times.decode_seconds - 5.004) < 1e-9
    at = {bound: count for bound, count in zip(STEP_BUCKETS_S, times.bucket_counts)}
    assert at[0.005] == 1 and at[0.02] == 1 and at[0.05] == 2 and at[2.0] == 2
    assert at[float("inf")] == 3


def test_a_prompt_in_chunks_then_its_answer(tiny_model_dir: Path) -> None:
    """A 40-token prompt in chunks of 16 tokens is three steps (the last one draws the first
    token), then every further token one decode step; a step with nothing to run is not
    counted."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=16,
              enable_prefix_caching=False, progress=False)
    core = llm.engine.core
    assert core.step() == [] and core.step_times.count == 0
    llm.generate([list(range(3, 43))], SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))
    times = core.step_times
    assert (times.count, times.decode_count) == (3 + 4, 4)
    assert 0 < times.decode_seconds < times.seconds
