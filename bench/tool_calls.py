"""Tool calling on a real model through the official ``openai`` client: forced calls are
valid, streams reassemble to the same calls, and a follow-up with the result answers.

    python bench/tool_calls.py [--url http://127.0.0.1:8000] [--seeds 3] [--max-tokens 384]
                               [--temperature T] [--top-p P] [--concurrency 1]
                               [--unbounded] [--serve-args "..."]

Without ``--url`` it starts ``freetoken serve`` on the embedded default model (SmolLM2,
whose ChatML template has no tool support: the generic tool prompt) and stops it after.
For each of the 20 tools of ``tool_schemas.py`` and each seed, with that tool and three
others in ``tools`` (``--temperature`` / ``--top-p`` are sent when given; otherwise the
server's defaults apply, e.g. ``--serve-args "--override-generation-config '{...}'"``):

* ``tool_choice`` naming the tool, ``tool_choice: "required"``, and ``"required"`` with
  ``parallel_tool_calls: false`` (``single``: exactly one call), each non-streamed and
  streamed: every call's ``function.arguments`` must parse and validate against its tool's
  schema (``jsonschema``, formats checked), ``finish_reason`` must be ``tool_calls``, and
  the streamed deltas (first delta: ``id``, ``type``, ``function.name``; then argument
  pieces) must reassemble to the non-streamed calls of the same seed;
* a follow-up (seed 0): the conversation with the assistant's call and a ``tool``
  message carrying a made-up result must render and answer.

Prints one line per failure and a summary; exits non-zero when anything failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tool_schemas import TOOLS, UNBOUNDED, ToolCase

CHECKER = jsonschema.FormatChecker()
CASES: list[ToolCase] = list(TOOLS)
"""The tools in use: ``TOOLS``, or ``UNBOUNDED`` with ``--unbounded``."""


@dataclass
class Outcome:
    case: str
    mode: str
    seed: int
    calls: list[tuple[str, str]]
    finish: str | None
    content: str | None
    errors: list[str]


def tools_for(i: int) -> list[dict[str, Any]]:
    """The case's tool and three others (a fixed choice per case)."""
    picks = [i, (i + 5) % 20, (i + 11) % 20, (i + 17) % 20]
    return [CASES[j].tool for j in picks]


def check_calls(calls: list[tuple[str, str]], allowed: dict[str, ToolCase]) -> list[str]:
    errors = []
    if not calls:
        errors.append("no call")
    for name, arguments in calls:
        if name not in allowed:
            errors.append(f"unknown tool {name}")
            continue
        try:
            jsonschema.validate(json.loads(arguments), allowed[name].schema,
                                format_checker=CHECKER)
        except (ValueError, jsonschema.ValidationError) as exc:
            errors.append(f"{name} arguments {arguments!r}: {str(exc).splitlines()[0]}")
    return errors


SAMPLING: dict[str, float] = {}
"""The sampling fields every request sends (``--temperature``, ``--top-p``)."""


def run_one(client: openai.OpenAI, model: str, i: int, mode: str, seed: int,
            stream: bool, max_tokens: int) -> Outcome:
    case = CASES[i]
    tools = tools_for(i)
    choice: Any = ({"type": "function", "function": {"name": case.name}} if mode == "named"
                   else "required")
    single = {"parallel_tool_calls": False} if mode == "single" else {}
    # A salt of its own: every request prefills its whole prompt, so the streamed and the
    # non-streamed run of a seed compute the same logits (a prefix-cache hit prefills fewer
    # rows, and float sums in another order can flip a seeded draw at a near-tie).
    salt = f"{case.name}-{mode}-{seed}-{stream}"
    kwargs = {"model": model, "messages": [{"role": "user", "content": case.ask}],
              "tools": tools, "tool_choice": choice, "seed": seed, "max_tokens": max_tokens,
              "extra_body": {"cache_salt": salt}, **SAMPLING, **single}
    errors: list[str] = []
    if stream:
        content, parts, finish = None, {}, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                if c.delta.content:
                    content = (content or "") + c.delta.content
                for call in c.delta.tool_calls or []:
                    if call.index not in parts:
                        if not (call.id and call.type == "function" and call.function.name):
                            errors.append(f"first delta of call {call.index} lacks id/type/name")
                        parts[call.index] = [call.function.name or "", ""]
                    elif call.id or call.function.name:
                        errors.append(f"a later delta of call {call.index} repeats id/name")
                    parts[call.index][1] += call.function.arguments or ""
                finish = c.finish_reason or finish
        calls = [(n, a) for n, a in (parts[k] for k in sorted(parts))]
    else:
        response = client.chat.completions.create(**kwargs)
        message = response.choices[0].message
        content, finish = message.content, response.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    allowed = {t["function"]["name"]: next(c for c in CASES if c.name == t["function"]["name"])
               for t in tools}
    if mode == "named":
        allowed = {case.name: case}
    errors += check_calls(calls, allowed)
    if mode == "single" and len(calls) != 1:
        errors.append(f"{len(calls)} calls with parallel_tool_calls false")
    if finish != "tool_calls":
        errors.append(f"finish_reason {finish}")
    if content:
        errors.append(f"content {content!r}")
    return Outcome(case.name, mode + (" stream" if stream else ""), seed, calls, finish,
                   content, errors)


def guarded(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or an ``Outcome``/error list naming the exception it raised."""
    try:
        return fn(*args)
    except openai.APIError as exc:
        if fn is follow_up:
            return [f"follow-up: {type(exc).__name__}: {exc}"]
        i, mode, seed, stream = args[2:6]
        return Outcome(CASES[i].name, mode + (" stream" if stream else ""), seed, [], None,
                       None, [f"{type(exc).__name__}: {exc}"])


def follow_up(client: openai.OpenAI, model: str, i: int, max_tokens: int) -> list[str]:
    case = CASES[i]
    messages: list[dict[str, Any]] = [{"role": "user", "content": case.ask}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=tools_for(i), seed=0, max_tokens=max_tokens,
        **SAMPLING,
        tool_choice={"type": "function", "function": {"name": case.name}})
    message = first.choices[0].message
    if first.choices[0].finish_reason != "tool_calls":
        return [f"follow-up: the first answer ended with {first.choices[0].finish_reason}"]
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                     "content": json.dumps({"status": "ok", "result": 42})})
    answer = client.chat.completions.create(model=model, messages=messages, tools=tools_for(i),
                                            seed=0, max_tokens=48, **SAMPLING)
    choice = answer.choices[0]
    if not (choice.message.content or choice.message.tool_calls):
        return ["follow-up: an empty answer"]
    return []


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = 8765
    proc = subprocess.Popen([sys.executable, "-m", "freetoken_core.cli", "serve", "--port",
                             str(port), "--log-level", "warning", *serve_args])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            sys.exit("freetoken serve exited")
        time.sleep(0.5)
    proc.kill()
    sys.exit("freetoken serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests at once (1: each alone, so a seed's two runs match)")
    parser.add_argument("--unbounded", action="store_true",
                        help="the tools without maxLength/maxProperties (tool_schemas.py)")
    parser.add_argument("--serve-args", default="", help="extra freetoken serve arguments")
    args = parser.parse_args()
    if args.unbounded:
        CASES[:] = UNBOUNDED
    for name in ("temperature", "top_p"):
        if getattr(args, name) is not None:
            SAMPLING[name] = getattr(args, name)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(shlex.split(args.serve_args))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=600)
        card = client.models.list().data[0]
        model = card.id
        print(f"sampling sent: {SAMPLING or 'none'}; server defaults: "
              f"{(card.model_extra or {}).get('generation_defaults')}")
        jobs = [(i, mode, seed, stream) for i in range(len(CASES))
                for mode in ("named", "required", "single") for seed in range(args.seeds)
                for stream in (False, True)]
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(
                lambda job: guarded(run_one, client, model, *job, args.max_tokens), jobs))
            follow = list(pool.map(
                lambda i: guarded(follow_up, client, model, i, args.max_tokens),
                range(len(CASES))))
        elapsed = time.monotonic() - started
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    failures = 0
    by_key = {(o.case, o.mode, o.seed): o for o in outcomes}
    for o in outcomes:
        if o.errors:
            failures += 1
            print(f"FAIL {o.case} {o.mode} seed {o.seed}: {'; '.join(o.errors)}")
        if o.mode.endswith(" stream"):
            whole = by_key[(o.case, o.mode.removesuffix(" stream"), o.seed)]
            if whole.calls != o.calls:
                failures += 1
                print(f"FAIL {o.case} {o.mode} seed {o.seed}: stream {o.calls} != "
                      f"non-stream {whole.calls}")
    for i, errors in enumerate(follow):
        for error in errors:
            failures += 1
            print(f"FAIL {CASES[i].name}: {error}")
    for mode in ("named", "named stream", "required", "required stream", "single",
                 "single stream"):
        mine = [o for o in outcomes if o.mode == mode]
        good = sum(not o.errors for o in mine)
        cut = sum(o.finish == "length" for o in mine)
        calls = sum(len(o.calls) for o in mine)
        print(f"{mode:16s} valid {good}/{len(mine)}  cut by max_tokens {cut}  calls {calls}")
    print(f"follow-ups answered: {sum(not f for f in follow)}/{len(follow)}")
    print(f"{len(outcomes) + 2 * len(follow)} requests in {elapsed:.0f} s; "
          f"{'OK' if not failures else f'{failures} failures'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
