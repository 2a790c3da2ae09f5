"""Structured outputs benchmark: how often the output is valid, what a grammar costs to
compile and per step, and what it does to throughput, for each grammar backend.

    python bench/structured_outputs.py [--backends llguidance,xgrammar] [--quick]
                                       [--max-tokens 256] [--url http://127.0.0.1:8000]

Offline (the default) each backend gets its own ``LLM`` on the embedded default model (or
``--model``); with ``--url`` the generations go to a running ``freetoken serve`` through
the official ``openai`` client (the server's own backend answers; compile and mask times
are still measured here, on the model's tokenizer, for ``--backends``). Measured:

* validity: each of the 30 schemas of ``json_schemas.py`` (chat prompt, ``response_format``
  json_schema) at temperature 0 and at temperature 1 with 3 seeds, all in one batch; the
  share of complete outputs that parse and validate (``jsonschema``, formats checked).
  Outputs cut by ``max_tokens`` are excluded and counted apart, as are refused requests;
* regex and choice: a few cases at temperature 0 and 1, matched in full;
* compile: ``backend.compile`` of each schema, cold (neither backend caches on its own),
  p50 / p99 / max;
* mask work per decode step at 16 and 64 rows: ``fill_bitmask`` of every row (matchers
  walking real documents, one token per step) plus ``apply_bitmask_torch`` on float32
  logits [rows, vocab];
* throughput: 16 concurrent requests (the first 16 schemas' prompts, greedy, ``ignore_eos``
  so every row runs ``max_tokens``) with their schema and without; output tokens/s and the
  ratio.

``--quick`` takes 8 schemas, one seed, 16 rows only and 128 tokens. The default run takes a
few minutes per backend on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_schemas import SCHEMAS, JsonCase

from freetoken_core.bench import load_bench_model
from freetoken_plugins.structured_outputs.backends import (
    GrammarBackend,
    Matcher,
    make_backend,
    num_bitmask_words,
)
from freetoken_plugins.structured_outputs.constraints import parse_constraint
from freetoken_plugins.structured_outputs.mask import apply_bitmask_torch

PATTERN_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("When did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
     {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Make up a US phone number.", {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"},
     r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("Make up an email address for Ada.", {"regex": r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"},
     r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"),
    ("Is 'I love this phone' positive, negative or neutral?",
     {"choice": ["positive", "negative", "neutral"]}, "positive|negative|neutral"),
    ("What is the capital of France?", {"choice": ["Paris", "London", "Berlin", "Madrid"]},
     "Paris|London|Berlin|Madrid"),
    ("Is water wet? Answer yes or no.", {"choice": ["yes", "no"]}, "yes|no"),
]


@dataclass(frozen=True)
class Job:
    """One generation: a chat prompt, its sampling and its constraint fields."""

    name: str
    prompt: str
    temperature: float
    seed: int | None
    fields: dict[str, Any]


@dataclass
class Result:
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    error: str | None = None


@dataclass
class Column:
    """One column of the table: a backend offline, or the server."""

    name: str
    rows: dict[str, str] = field(default_factory=dict)


def schema_format(case: JsonCase) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": case.name, "schema": case.schema, "strict": True}}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- generation: offline or through a server --------------------------------------------


class Offline:
    """``LLM.generate`` on one backend; every call is one batch."""

    def __init__(self, model: str | None, backend: str) -> None:
        from freetoken_core import LLM

        self.llm = LLM(model, max_num_seqs=64, progress=False,
                       plugin_options={"structured_outputs_backend": backend})

    def chat(self, content: str) -> str:
        from freetoken_core.tokenizer import apply_chat_template

        return apply_chat_template(self.llm.tokenizer, [{"role": "user", "content": content}])

    def run(self, jobs: list[Job], max_tokens: int) -> list[Result]:
        from freetoken_core import SamplingParams

        prompts = [self.chat(job.prompt) for job in jobs]
        params = [SamplingParams(temperature=job.temperature, seed=job.seed,
                                 max_tokens=max_tokens, **job.fields) for job in jobs]
        results = []
        for out in self.llm.generate(prompts, params):
            choice = out.outputs[0]
            results.append(Result(choice.text, choice.finish_reason, len(choice.token_ids),
                                  out.error))
        return results


class Remote:
    """The same jobs as concurrent chat requests to a running server."""

    def __init__(self, url: str, concurrency: int = 64) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="x",
                                    max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id
        self.concurrency = concurrency

    def one(self, job: Job, max_tokens: int) -> Result:
        import openai

        extra = dict(job.fields)
        response_format = extra.pop("response_format", None)
        kwargs: dict[str, Any] = {} if response_format is None else {
            "response_format": response_format}
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": job.prompt}],
                temperature=job.temperature, seed=job.seed, max_tokens=max_tokens,
                extra_body=extra or None, **kwargs)
        except openai.APIError as exc:
            return Result(error=str(exc))
        choice = response.choices[0]
        return Result(choice.message.content or "", choice.finish_reason,
                      response.usage.completion_tokens if response.usage else 0)

    def run(self, jobs: list[Job], max_tokens: int) -> list[Result]:
        with ThreadPoolExecutor(min(self.concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self.one(job, max_tokens), jobs))


# -- the measurements -------------------------------------------------------------------


def validity(runner: Offline | Remote, cases: list[JsonCase], seeds: list[int],
             max_tokens: int, column: Column) -> dict[str, str]:
    """Fill the validity rows; return each schema's tokens of a valid greedy document."""
    jobs = [Job(case.name, case.prompt, 0.0, None, schema_format(case)) for case in cases]
    jobs += [Job(case.name, case.prompt, 1.0, seed, schema_format(case)) for seed in seeds
             for case in cases]
    by_name = {case.name: case for case in cases}
    start = time.perf_counter()
    results = runner.run(jobs, max_tokens)
    elapsed = time.perf_counter() - start
    checker = jsonschema.FormatChecker()
    tally = {0.0: [0, 0], 1.0: [0, 0]}  # temperature -> [valid, complete]
    cut = refused = 0
    invalid: list[str] = []
    documents: dict[str, str] = {}
    for job, result in zip(jobs, results):
        case = by_name[job.name]
        if result.error is not None or result.finish_reason == "error":
            refused += 1
            continue
        if result.finish_reason == "length":
            cut += 1
            continue
        tally[job.temperature][1] += 1
        try:
            document = json.loads(result.text)
            jsonschema.validate(document, case.schema, format_checker=checker)
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append(f"{case.name} (t={job.temperature:g}): {str(exc).splitlines()[0]}")
            continue
        tally[job.temperature][0] += 1
        if job.temperature == 0:
            documents[case.name] = result.text
    for temperature, (valid, complete) in tally.items():
        share = f"{100 * valid / complete:.1f}%" if complete else "-"
        column.rows[f"JSON valid of complete, t={temperature:g}"] = (
            f"{valid}/{complete} {share}")
    column.rows["cut by max_tokens (excluded)"] = str(cut)
    column.rows["refused / failed"] = str(refused)
    column.rows["generations, wall s"] = f"{len(jobs)}, {elapsed:.0f}"
    for line in invalid:
        print(f"  [{column.name}] invalid: {line}", file=sys.stderr)
    return documents


def patterns(runner: Offline | Remote, max_tokens: int, column: Column) -> None:
    jobs = [Job(str(i), prompt, t, 0 if t else None, {"structured_outputs": fields})
            for i, (prompt, fields, _) in enumerate(PATTERN_CASES) for t in (0.0, 1.0)]
    results = runner.run(jobs, max_tokens)
    matched = sum(result.finish_reason == "stop" and re.fullmatch(pattern, result.text)
                  is not None for result, (_, _, pattern) in
                  zip(results, [c for c in PATTERN_CASES for _ in range(2)]))
    column.rows["regex + choice matched"] = f"{matched}/{len(jobs)}"


def throughput(runner: Offline | Remote, cases: list[JsonCase], max_tokens: int,
               column: Column) -> None:
    runner.run([Job(cases[0].name, cases[0].prompt, 0.0, None, schema_format(cases[0]))],
               4)  # warm-up
    # ``ignore_eos``: both runs generate exactly ``max_tokens`` per row, so the ratio is the
    # constraint's cost (a constrained document that completes early runs on with EOS only,
    # still masked), not a difference in how long the documents are.
    rates = {}
    for label, with_schema in (("plain", False), ("schema", True)):
        jobs = [Job(case.name, case.prompt, 0.0, None,
                    {**(schema_format(case) if with_schema else {}), "ignore_eos": True})
                for case in cases]
        start = time.perf_counter()
        results = runner.run(jobs, max_tokens)
        elapsed = time.perf_counter() - start
        rates[label] = sum(r.num_tokens for r in results) / elapsed
    column.rows[f"tok/s, {len(cases)} rows: plain / schema"] = (
        f"{rates['plain']:.0f} / {rates['schema']:.0f}")
    column.rows["tok/s ratio schema / plain"] = f"{rates['schema'] / rates['plain']:.2f}"


def compile_times(backend: GrammarBackend, cases: list[JsonCase], column: Column) -> None:
    times = []
    for case in cases:
        constraint = parse_constraint(schema_format(case)["response_format"], None)
        assert constraint is not None
        start = time.perf_counter()
        backend.compile(constraint, "bench")
        times.append((time.perf_counter() - start) * 1e3)
    column.rows[f"compile ms p50 / p99 / max ({len(cases)}, cold)"] = (
        f"{statistics.median(times):.1f} / {percentile(times, 99):.1f} / {max(times):.1f}")


def mask_work(backend: GrammarBackend, tokenizer: Any, documents: dict[str, str],
              rows: int, column: Column, num_steps: int = 24) -> None:
    """Per step: ``fill_bitmask`` of ``rows`` matchers, each walking a valid document (one
    token per step, from a different offset per row, restarting at its end), then
    ``apply_bitmask_torch`` on [rows, vocab] float32 logits."""
    names = [case.name for case in SCHEMAS if case.name in documents] or [SCHEMAS[0].name]
    by_name = {case.name: case for case in SCHEMAS}
    compiled = {name: backend.compile(parse_constraint(
        schema_format(by_name[name])["response_format"], None), "bench") for name in names}
    tokens = {name: tokenizer.encode(documents.get(name, "{"), add_special_tokens=False)
              for name in names}

    def fresh(row: int) -> tuple[Matcher, list[int]]:
        name = names[row % len(names)]
        matcher, walk = backend.matcher(compiled[name]), tokens[name]
        for token in walk[:(row * 7) % max(1, len(walk) - 1)]:
            matcher.accept(token)
        return matcher, walk[(row * 7) % max(1, len(walk) - 1):]

    state = [fresh(row) for row in range(rows)]
    vocab = backend.vocab.vocab_size
    bitmask = torch.zeros(rows, num_bitmask_words(vocab), dtype=torch.int32)
    index = torch.arange(rows)
    fills, applies = [], []
    for _ in range(num_steps):
        logits = torch.randn(rows, vocab)
        start = time.perf_counter()
        for row, (matcher, _) in enumerate(state):
            matcher.fill_bitmask(bitmask, row)
        middle = time.perf_counter()
        apply_bitmask_torch(logits, bitmask, index)
        end = time.perf_counter()
        fills.append((middle - start) * 1e3)
        applies.append((end - middle) * 1e3)
        for row, (matcher, walk) in enumerate(state):
            if not walk or not matcher.accept(walk[0]):
                state[row] = fresh(row + 1)
            else:
                state[row] = (matcher, walk[1:])
    fill, apply = statistics.median(fills), statistics.median(applies)
    column.rows[f"mask ms/step, {rows} rows: fill + apply"] = (
        f"{fill:.2f} + {apply:.2f} = {fill + apply:.2f}")


# -- the run ----------------------------------------------------------------------------


def local_grammar(model: str | None) -> tuple[Any, int, list[int]]:
    """The model's tokenizer, logits width and EOS ids, without loading its weights."""
    source = load_bench_model(model)
    return source.tokenizer, source.vocab_size, sorted(source.eos_token_ids)


def print_table(columns: list[Column]) -> None:
    names = list(dict.fromkeys(name for column in columns for name in column.rows))
    width = max(len(name) for name in names) + 2
    widths = [max(len(column.name), *(len(v) for v in column.rows.values())) + 2
              for column in columns]
    print(f"{'':<{width}}" + "".join(f"{c.name:>{w}}" for c, w in zip(columns, widths)))
    for name in names:
        print(f"{name:<{width}}" + "".join(f"{c.rows.get(name, '-'):>{w}}"
                                            for c, w in zip(columns, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="llguidance,xgrammar")
    parser.add_argument("--model", default=None, help="offline model (default: embedded)")
    parser.add_argument("--url", default=None, help="a running freetoken serve")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per generation (default: 256, --quick 128)")
    parser.add_argument("--quick", action="store_true", help="a small subset")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    quick = args.quick
    cases = SCHEMAS[:8] if quick else SCHEMAS
    seeds = [0] if quick else [0, 1, 2]
    max_tokens = args.max_tokens or (128 if quick else 256)
    row_counts = [16] if quick else [16, 64]
    throughput_cases = SCHEMAS[:16]
    tokenizer, vocab_size, eos = local_grammar(args.model)
    print(f"{len(cases)} schemas x (t=0 + t=1 x {len(seeds)} seeds), max_tokens {max_tokens}, "
          f"vocabulary {vocab_size}, torch threads {torch.get_num_threads()}", flush=True)

    columns: list[Column] = []
    documents: dict[str, str] = {}
    runners: list[tuple[str, Callable[[], Offline | Remote]]] = (
        [("server", lambda: Remote(args.url))] if args.url else
        [(b, lambda b=b: Offline(args.model, b)) for b in backends])
    for name, make in runners:
        column = Column(name)
        columns.append(column)
        print(f"[{name}] generating ...", file=sys.stderr, flush=True)
        runner = make()
        documents.update(validity(runner, cases, seeds, max_tokens, column))
        patterns(runner, 32, column)
        throughput(runner, throughput_cases, max_tokens, column)
        del runner
    for backend_name in backends:
        column = next((c for c in columns if c.name == backend_name), None)
        if column is None:
            column = Column(backend_name)
            columns.append(column)
        print(f"[{backend_name}] compile and mask ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        backend = make_backend(backend_name, tokenizer, vocab_size, eos)
        column.rows["backend build s"] = f"{time.perf_counter() - start:.2f}"
        compile_times(backend, SCHEMAS, column)
        for rows in row_counts:
            mask_work(backend, tokenizer, documents, rows, column)
    print_table(columns)


if __name__ == "__main__":
    main()
