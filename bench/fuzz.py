"""Fuzz a running ``freetoken serve`` from its own OpenAPI document (schemathesis).

    python bench/fuzz.py [--model PATH] [--cases 2000] [--seed 0] [--max-model-len 128]

Starts the server on a free loopback port (a tiny random-weight Llama built with
``tests/tiny_models.make_tiny_model`` unless ``--model``: a path, or ``default`` for the
embedded default model; ``--api-key`` set), loads
``/schema/openapi.json`` and, for every operation in it, sends schemathesis-generated
requests: bodies that fit the schema (positive) and bodies that break it (negative), plus
one request without the API key. Every response is checked:

- every check schemathesis has (its default set: no status >= 500, the status, content
  type, headers and body the document declares, a 405 with ``Allow`` for an unsupported
  method, schema-invalid data refused, the API key enforced, ...), except that
  schema-valid data may be refused (400) only by a rule the document states for the
  field the error names (``documented_refusal``: its ``x-freetoken-checks``, for what
  JSON Schema cannot express, such as a prompt that must fit the context);
- every 4xx is the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

Afterwards ``/health`` must be 200 and ``/internal/stats`` show 0 running sequences and
0 used KV blocks. Prints the number of cases per operation and status, and every failure
(with the request as a curl command); exits 1 on any failure. ``tests/test_fuzz.py``
runs a short version of the same fuzz (``run_fuzz``) in the test suite.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

API_KEY = "fuzz-key"
REQUEST_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 30.0


def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx body is ``{"error": {"message": str, "type": str, "param": str | null,
    "code": str | int | null}}`` (a schemathesis check)."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: "
                             f"{response.content[:200]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    ok = (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
          and isinstance(error["message"], str) and isinstance(error["type"], str)
          and isinstance(error["param"], (str, type(None)))
          and isinstance(error["code"], (str, int, type(None))))
    if not ok:
        raise AssertionError(f"{response.status_code} body is not an OpenAI error: {body!r}")
    return None


CHECKS = "x-freetoken-checks"


def _checked_fields(document: dict[str, Any]) -> dict[str, set[str]]:
    """Per operation label (``POST /v1/completions``), the request fields whose schema
    carries ``x-freetoken-checks`` (rules the server checks beyond the schema)."""
    schemas = document.get("components", {}).get("schemas", {})
    out: dict[str, set[str]] = {}
    for path, item in document.get("paths", {}).items():
        for method, op in item.items():
            media = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = media.get("schema", {}).get("$ref", "")
            props = schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})
            out[f"{method.upper()} {path}"] = {name for name, prop in props.items()
                                               if CHECKS in prop}
    return out


def documented_refusal(checked: dict[str, set[str]]) -> Callable[..., bool | None]:
    """A schemathesis check in place of ``positive_data_acceptance``: schema-valid data
    refused with a 400 passes only when the error's ``param`` is (in) a field that
    ``checked`` says has rules beyond its schema."""

    def check(ctx: Any, response: Any, case: Any) -> bool | None:
        meta = case.meta
        if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
            return None
        try:
            param = json.loads(response.content)["error"]["param"] or ""
        except (ValueError, KeyError, TypeError):
            param = ""
        field_name = param.split(".")[0].split("[")[0]
        label = f"{case.operation.method.upper()} {case.operation.path}"
        if field_name not in checked.get(label, set()):
            raise AssertionError(f"schema-valid data refused with 400 naming {param!r}, a "
                                 "field for which the document states no rule beyond its "
                                 f"schema: {response.content[:300]!r}")
        return None

    check.__name__ = "documented_refusal"
    return check


@dataclass
class FuzzReport:
    """Status counts per operation (``"POST /v1/completions"``) and the failures seen."""

    counts: dict[str, collections.Counter[int]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: list[str] = field(default_factory=list)

    @property
    def num_cases(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    @property
    def num_server_errors(self) -> int:
        return sum(n for c in self.counts.values() for status, n in c.items() if status >= 500)

    def table(self) -> str:
        statuses = sorted({s for c in self.counts.values() for s in c})
        width = max(len(op) for op in self.counts)
        lines = [f"{'operation'.ljust(width)}  " + "  ".join(f"{s:>5}" for s in statuses)
                 + "  total"]
        for op, c in sorted(self.counts.items()):
            lines.append(f"{op.ljust(width)}  " + "  ".join(f"{c.get(s, 0):>5}" for s in statuses)
                         + f"  {sum(c.values()):>5}")
        lines.append(f"{'all'.ljust(width)}  " + "  ".join(
            f"{sum(c.get(s, 0) for c in self.counts.values()):>5}" for s in statuses)
            + f"  {self.num_cases:>5}")
        return "\n".join(lines)


def run_fuzz(url: str, api_key: str | None, cases_per_operation: int, seed: int = 0,
             log: Callable[[str], None] = print,
             document: dict[str, Any] | None = None) -> FuzzReport:
    """Fuzz every operation of ``url``'s OpenAPI document with up to
    ``cases_per_operation`` positive and as many negative cases (operations without any
    input get one case per mode), plus one case without the API key when there is one.
    Never raises on a failed check: the failures are in the report. ``document`` replaces
    the server's own OpenAPI document (to check that a lying one fails)."""
    import requests
    import schemathesis
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if document is None:
        answer = httpx.get(f"{url}/schema/openapi.json", headers=headers, timeout=30)
        answer.raise_for_status()
        document = answer.json()
    schema = schemathesis.openapi.from_dict(document)
    additional = [openai_error_shape, documented_refusal(_checked_fields(document))]
    report = FuzzReport()

    def call(case: Any, label: str, case_headers: dict[str, str]) -> None:
        try:
            response = case.call(base_url=url, headers=case_headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:  # a reset or a timeout fails too
            report.counts[label][599] += 1
            report.failures.append(f"{label}: no response: {type(exc).__name__}: {exc}\n"
                                   f"    {case.as_curl_command(headers=case_headers)}")
            log(f"FAILED {label}: no response ({type(exc).__name__})")
            return
        report.counts[label][response.status_code] += 1
        try:
            # Every check schemathesis has (its default set), and the OpenAI error body.
            case.validate_response(response, additional_checks=additional,
                                   excluded_checks=[positive_data_acceptance],
                                   headers=case_headers)
        except (AssertionError, FailureGroup) as exc:  # one error naming every failed check
            report.failures.append(
                f"{label} -> {response.status_code}: {exc}\n    body sent: "
                f"{json.dumps(case.body, default=repr)[:2000] if case.body is not None else '-'}"
                f"\n    answer: {response.content[:500]!r}")
            log(f"FAILED {label} -> {response.status_code}")

    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        started = time.monotonic()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _draw(operation.as_strategy(generation_mode=mode), cases_per_operation, seed,
                  functools.partial(call, label=label, case_headers=headers))
        if api_key:
            call(_plain_case(operation), label, {})  # must be a 401 (bar /health)
        log(f"{label}: {sum(report.counts[label].values())} cases in "
            f"{time.monotonic() - started:.1f} s")
    return report


def _draw(strategy: Any, num_cases: int, seed: int, on_case: Callable[[Any], None]) -> None:
    """``on_case`` on up to ``num_cases`` examples of ``strategy`` (no shrinking: a failure
    is recorded, never raised)."""
    import hypothesis

    @hypothesis.settings(max_examples=num_cases, database=None, deadline=None,
                         phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.seed(seed)
    @hypothesis.given(case=strategy)
    def one(case: Any) -> None:
        on_case(case)

    try:
        one()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to break (negative mode of a route without input)


def _plain_case(operation: Any) -> Any:
    """A case with the operation's required input at its simplest (for the no-key call)."""
    path_parameters = {p.name: "x" for p in operation.path_parameters}
    if not operation.body:
        return operation.Case(path_parameters=path_parameters or None)
    return operation.Case(body={}, media_type="application/json",
                          path_parameters=path_parameters or None)


def drain(srv: Any) -> list[str]:
    """Keep reading the server's output (a full pipe would stall it); the lines so far."""
    lines: list[str] = []

    if srv.proc.stdout is not None:
        threading.Thread(target=lambda: lines.extend(srv.proc.stdout), daemon=True).start()
    return lines


def settle(url: str, api_key: str | None) -> list[str]:
    """Problems with the server after the fuzz: ``/health`` not 200, or sequences or KV
    blocks still held once ``SETTLE_TIMEOUT_S`` has passed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    health = httpx.get(f"{url}/health", timeout=30).status_code
    problems = [] if health == 200 else [f"/health answered {health} after the fuzz"]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stats: dict[str, int] = {}
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/internal/stats", headers=headers, timeout=30).json()
        if stats.get("num_running") == 0 and stats.get("num_used_kv_blocks") == 0:
            return problems
        time.sleep(0.5)
    problems.append(f"after the fuzz the engine still holds sequences or KV blocks: {stats}")
    return problems


def main() -> int:
    from server_fixtures import start_server, stop_server

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model directory or .gguf, or 'default' for the embedded "
                             "default model (default: a tiny random-weight Llama)")
    parser.add_argument("--cases", type=int, default=2000,
                        help="total cases wanted, spread over the operations (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=128,
                        help="keeps every generation short (default 128)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from tiny_models import make_tiny_model

            model: Path | None = make_tiny_model(Path(tmp) / "tiny-llama", "llama")
        else:
            model = None if args.model == "default" else Path(args.model)
        srv = start_server(model, "--api-key", API_KEY,
                           "--max-model-len", str(args.max_model_len), api_key=API_KEY)
        log_lines = drain(srv)
        try:
            document = httpx.get(f"{srv.url}/schema/openapi.json", timeout=30,
                                 headers={"Authorization": f"Bearer {API_KEY}"}).json()
            num_operations = sum(len(item) for item in document["paths"].values())
            # Two modes per operation; /health (no input, no key) gives one case per mode,
            # so the share is over the other operations.
            per_operation = -(-args.cases // (2 * (num_operations - 1))) + 5
            report = run_fuzz(srv.url, API_KEY, per_operation, args.seed)
            problems = settle(srv.url, API_KEY)
        finally:
            stop_server(srv)
            server_log = "".join(log_lines)
    print(report.table())
    for failure in report.failures:
        print(f"\nFAILED {failure}")
    for problem in problems:
        print(f"\nFAILED {problem}")
    if report.failures and server_log.strip():
        print("\nserver log (last 20,000 characters):\n" + server_log[-20_000:])
    print(f"\n{report.num_cases} cases, {report.num_server_errors} answered >= 500, "
          f"{len(report.failures)} failed checks, {len(problems)} problems after")
    if report.num_cases < args.cases:
        print(f"FAILED only {report.num_cases} cases (wanted {args.cases})")
        return 1
    return 1 if report.failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
