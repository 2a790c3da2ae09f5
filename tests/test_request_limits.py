"""Request limits (``RequestLimits``: 400 naming the field, 413 for the body) and
tokenization off the event loop (``TokenizerPool``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_fixtures import Server, start_server, stop_server
from server_fixtures import post as _post
from tiny_models import build_tokenizer

from freetoken_core.cli import main as cli_main
from freetoken_core.config import EngineConfig
from freetoken_core.engine.output_processor import StopMatcher
from freetoken_core.engine.process import Update
from freetoken_core.errors import InvalidRequest
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server import openai_routes
from freetoken_core.server.limits import TOKENIZER_NICENESS, RequestLimits, count_prompts
from freetoken_core.server.openai_routes import run_generation
from freetoken_core.server.protocol import ChatMessage
from freetoken_core.server.state import ServerConfig, Serving

# --------------------------------------------------------------------------- unit


@pytest.mark.parametrize("name", ["max_stop_strings", "max_prompt_chars", "max_body_bytes",
                                  "num_tokenizer_threads"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, None])
def test_limits_are_validated_on_construction(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        RequestLimits(**{name: value})
    assert info.value.param == name


def test_defaults_allow_what_openai_and_vllm_clients_send() -> None:
    limits = RequestLimits()
    limits.check_stop(["\n\n", "User:", "###", "</s>"])  # OpenAI's maximum of 4
    limits.check_stop(["x" * 1024] * 64)
    limits.check_sequences(1, 16)
    limits.check_sequences(1024, 2)
    limits.check_prompt_chars(1_000_000, "prompt")
    limits.check_messages([ChatMessage("user", "x" * 500_000),
                           ChatMessage("user", [{"type": "text", "text": "y" * 500_000}])])


def test_each_violation_names_its_field() -> None:
    limits = RequestLimits(max_stop_strings=2, max_stop_string_chars=5, max_prompts=3,
                           max_sequences=4, max_prompt_chars=10)
    cases = [
        (lambda: limits.check_stop(["a", "b", "c"]), "stop"),
        (lambda: limits.check_stop("abcdef"), "stop"),
        (lambda: limits.check_stop(["ok", "abcdef"]), "stop"),
        (lambda: limits.check_sequences(4, 1), "prompt"),
        (lambda: limits.check_sequences(3, 2), "n"),
        (lambda: limits.check_sequences(1, 5), "n"),
        (lambda: limits.check_prompt_chars(11, "prompt"), "prompt"),
        (lambda: limits.check_messages([ChatMessage("user", "123456"),
                                        ChatMessage("assistant", "abcde")]), "messages"),
        (lambda: limits.check_messages(
            [ChatMessage("user", [{"type": "text", "text": "x" * 11}])]), "messages"),
    ]
    for check, param in cases:
        with pytest.raises(InvalidRequest) as info:
            check()
        assert info.value.param == param
    # Right at each limit is allowed.
    limits.check_stop(["abcde", "x"])
    limits.check_sequences(3, 1)
    limits.check_sequences(2, 2)
    limits.check_prompt_chars(10, "prompt")
    limits.check_messages([ChatMessage("user", "12345"), ChatMessage("user", None)])


def test_count_prompts() -> None:
    assert count_prompts("hello") == (1, 5)
    assert count_prompts(["ab", "cde"]) == (2, 5)
    assert count_prompts([1, 2, 3]) == (1, 0)
    assert count_prompts([[1, 2], [3]]) == (2, 0)


def test_a_bad_limit_flag_is_a_start_up_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--max-stop-strings", "0", "--plugins", "none"]) == 2
    assert "max_stop_strings" in capsys.readouterr().err


# --------------------------------------------------------------------------- off the loop


class RecordingTokenizer:
    """Delegates to a real tokenizer; records the thread of every encode and template."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.threads: dict[str, set[int]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in ("encode", "apply_chat_template"):
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.setdefault(name, set()).add(threading.get_ident())
            return attr(*args, **kwargs)

        return recorded


class FakeEngine:
    """Answers every choice with two tokens, the second one finishing it."""

    ready = True

    async def generate(self, prompts: list[tuple[str, list[int]]],
                       params: SamplingParams, is_chat: bool = False
                       ) -> AsyncIterator[Update]:
        for request_id, _ in prompts:
            for index in range(params.n):
                yield Update(request_id, index, 100, None, None, 0)
                yield Update(request_id, index, 101, "length", None, 0)

    def stop_sequence(self, request_id: str, index: int, stop_reason: Any) -> None:
        pass


class FakeRequest:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def body(self) -> bytes:
        return self._body


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> RecordingTokenizer:
    return RecordingTokenizer(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def make_serving(tokenizer: Any, limits: RequestLimits) -> Serving:
    serving = Serving(ServerConfig(EngineConfig(), "m", limits=limits),
                      FakeEngine())  # type: ignore[arg-type]
    serving.tokenizer = tokenizer
    serving.tokenizer_pool.attach(tokenizer)
    serving.plugins = PluginManager("none")
    serving.model_info = ModelInfo(tokenizer.vocab_size + 16, frozenset({0}), 2048)
    return serving


def generate(serving: Serving, body: bytes, chat: bool) -> tuple[Any, int]:
    """Run one request; its response and the event loop's thread."""

    async def go() -> tuple[Any, int]:
        return await run_generation(serving, FakeRequest(body), chat), threading.get_ident()

    return asyncio.run(go())


def test_run_generation_tokenizes_and_renders_off_the_loop(
        recording: RecordingTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    matcher_threads: set[int] = set()

    class RecordingMatcher(StopMatcher):
        def __init__(self, stops: list[str]) -> None:
            matcher_threads.add(threading.get_ident())
            super().__init__(stops)

    monkeypatch.setattr(openai_routes, "StopMatcher", RecordingMatcher)
    serving = make_serving(recording, RequestLimits())
    response, loop_thread = generate(
        serving, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', True)
    assert response.choices[0].finish_reason == "length"
    response, loop_thread_2 = generate(
        serving, b'{"model": "m", "prompt": ["one", "two"], "n": 2, "stop": ["x"]}', False)
    assert len(response.choices) == 4
    assert set(recording.threads) == {"encode", "apply_chat_template"}
    assert len(matcher_threads) >= 1
    for threads in [*recording.threads.values(), matcher_threads]:
        assert loop_thread not in threads and loop_thread_2 not in threads


def test_a_refusal_raised_in_the_worker_thread_still_names_its_field(
        recording: RecordingTokenizer) -> None:
    """The content fits the limit; the rendered chat text (with the template) does not."""
    serving = make_serving(recording, RequestLimits(max_prompt_chars=20))
    with pytest.raises(InvalidRequest) as info:
        generate(serving, b'{"model": "m", "messages": [{"role": "user", '
                          b'"content": "0123456789"}]}', True)
    assert info.value.param == "messages" and "before tokenization" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        generate(serving, b'{"model": "m", "prompt": "0123456789012345678901"}', False)
    assert info.value.param == "prompt"


def test_long_texts_are_encoded_in_an_idle_priority_process(recording: RecordingTokenizer
                                                             ) -> None:
    """Text above ``idle_priority_chars`` is encoded by a ``SCHED_IDLE`` child process (a
    ``SCHED_IDLE`` thread would stall the event loop on every GIL hand-off), exactly as the
    tokenizer encodes it; shorter text in the niced worker threads. The tokenizer's own
    thread pool is off, so the encoding runs where it was sent."""
    serving = make_serving(recording, RequestLimits(idle_priority_chars=50))
    pool = serving.tokenizer_pool
    inner = recording._inner
    texts = ["word " * 20, "<|im_start|>user\nhéllo wörld 日本語 " * 4 + "<|im_end|>",
             "  leading and trailing spaces  " * 3, "x" * 51]
    recording.threads.clear()
    for text in texts:
        for special in (False, True):
            assert pool.encode(recording, text, special) == inner.encode(
                text, add_special_tokens=special), (text, special)
    assert "encode" not in recording.threads  # none of them was encoded in this process
    encoder = pool.idle_encoder
    assert encoder is not None and encoder.pid is not None
    pid = encoder.pid
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    assert "torch" not in " ".join(m.path for m in psutil.Process(pid).memory_maps())
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"

    seen: list[tuple[int, int]] = []

    def short() -> list[int]:
        seen.append((threading.get_ident(), os.getpriority(os.PRIO_PROCESS,
                                                           threading.get_native_id())))
        return pool.encode(recording, "word " * 10)

    assert asyncio.run(pool.run(short)) == inner.encode("word " * 10, add_special_tokens=False)
    ((thread, niceness),) = seen
    assert recording.threads["encode"] == {thread} and niceness >= TOKENIZER_NICENESS

    # Through a request: the long prompt's encoding leaves this process.
    recording.threads.clear()
    generate(serving, b'{"model": "m", "prompt": "' + b"word " * 20 + b'"}', False)
    generate(serving, b'{"model": "m", "messages": [{"role": "user", "content": "'
             + b"word " * 12 + b'"}]}', True)
    assert "encode" not in recording.threads and recording.threads["apply_chat_template"]

    # A dead encoder process costs one text encoded here, then a new process serves.
    child = psutil.Process(pid)
    child.kill()
    child.wait(10)
    assert pool.encode(recording, texts[0]) == inner.encode(texts[0], add_special_tokens=False)
    assert recording.threads["encode"]
    recording.threads.pop("encode")
    assert pool.encode(recording, texts[1]) == inner.encode(texts[1], add_special_tokens=False)
    assert "encode" not in recording.threads
    assert encoder.pid not in (None, pid)
    pool.shutdown()
    assert encoder.pid is None and not psutil.pid_exists(pid)


def test_the_encoder_process_ends_with_the_server(recording: RecordingTokenizer,
                                                  tmp_path: Path) -> None:
    """A server killed without shutting down leaves no encoder behind (it reads EOF)."""
    recording._inner.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    script = (
        "import os, sys\n"
        "from tokenizers import Tokenizer\n"
        "from freetoken_core.server.limits import IdleEncoder\n"
        f"encoder = IdleEncoder(Tokenizer.from_file({str(tmp_path / 'tokenizer.json')!r}))\n"
        "assert encoder.encode('word ' * 100, False)\n"
        "print(encoder.pid, flush=True)\n"
        "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    child = int(done.stdout.strip())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the encoder process outlived its server"
        time.sleep(0.05)


# --------------------------------------------------------------------------- server

LIMIT_FLAGS = ("--max-stop-strings", "3", "--max-stop-string-chars", "10", "--max-prompts", "3",
               "--max-sequences", "4", "--max-prompt-chars", "60000",
               "--max-body-bytes", "200000", "--tokenizer-threads", "2",
               "--max-cache-salt-chars", "8", "--idle-priority-chars", "1000")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, *LIMIT_FLAGS)
    yield srv
    stop_server(srv)


def refused(server: Server, path: str, body: dict, param: str, status: int = 400) -> str:
    r = _post(server, path, {"model": server.model, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_server_refuses_each_limit_by_field(server: Server) -> None:
    chat = [{"role": "user", "content": "hi"}]
    refused(server, "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d"]}, "stop")
    refused(server, "/v1/chat/completions", {"messages": chat, "stop": "x" * 11}, "stop")
    refused(server, "/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt")
    refused(server, "/v1/completions", {"prompt": [[1], [2], [3], [4]]}, "prompt")
    refused(server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n")
    refused(server, "/v1/chat/completions", {"messages": chat, "n": 5}, "n")
    refused(server, "/v1/completions", {"prompt": "x" * 60_001}, "prompt")
    refused(server, "/v1/completions", {"prompt": ["x" * 30_000, "y" * 30_001]}, "prompt")
    refused(server, "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 60_001}]}, "messages")
    refused(server, "/tokenize", {"prompt": "x" * 60_001}, "prompt")
    refused(server, "/v1/completions", {"prompt": "hi", "cache_salt": "x" * 9}, "cache_salt")
    refused(server, "/tokenize", {"messages": [{"role": "user", "content": "x" * 60_001}]},
            "messages")


def test_server_refuses_a_large_body_with_413(server: Server) -> None:
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "x" * 200_001})
    assert r.status_code == 413, r.text
    assert "error" in r.json()


def test_a_long_prompt_within_limits_is_refused_by_the_context_length(server: Server) -> None:
    """Tokenized off the loop, then checked against the context (2,048 tokens)."""
    message = refused(server, "/v1/completions", {"prompt": "hello world " * 4_900}, "prompt")
    assert "context" in message
    count = _post(server, "/tokenize", {"prompt": "hello world " * 4_900}).json()["count"]
    assert count > 2048


def test_requests_at_the_limits_are_served(server: Server) -> None:
    r = _post(server, "/v1/completions", {
        "model": server.model, "prompt": ["a", "b"], "n": 2, "max_tokens": 4,
        "temperature": 0, "ignore_eos": True, "stop": ["0123456789", "zz", "\n\n"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    r = _post(server, "/detokenize", {"model": server.model, "tokens": [1, 2, 3]})
    assert r.status_code == 200, r.text
