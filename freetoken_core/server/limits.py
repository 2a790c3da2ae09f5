"""Bounds on the work one HTTP request may ask for, and the threads that tokenize.

``RequestLimits`` is part of ``ServerConfig`` (one ``freetoken serve`` flag per field; the
defaults and flags are listed in ``docs/operations.md``). Its ``check_*`` methods raise
``InvalidRequest`` naming the request field (``stop``, ``prompt``, ``n``, ``messages``), so
every violation is a 400 before any tokenizer, template or engine work starts. The body
size is enforced by Litestar (``request_max_body_size``: 413).

``TokenizerPool`` runs tokenization and chat-template rendering in worker threads, so that
a long prompt does not stall the event loop that streams every other request, and encodes
long texts in a process at idle CPU priority.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, TypeVar

from freetoken_core.errors import InvalidRequest

R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits of ``freetoken serve``; every field is an int ≥ 1.

    The defaults are meant to be out of the way of any OpenAI or vLLM client (OpenAI
    allows 4 stop strings and ``n`` ≤ 128; the context length, checked after
    tokenization, is what refuses a prompt that is merely too long for the model).
    """

    max_stop_strings: int = 64
    """Stop strings in one request (``--max-stop-strings``)."""
    max_stop_string_chars: int = 1024
    """Characters in one stop string (``--max-stop-string-chars``)."""
    max_prompts: int = 1024
    """Prompts in one completions request, whose ``prompt`` may be a list (``--max-prompts``)."""
    max_sequences: int = 2048
    """Sequences one request runs: prompts × ``n`` (``--max-sequences``)."""
    max_prompt_chars: int = 1_048_576
    """Characters of prompt text in one request before tokenization: the sum over the
    string prompts (plus the string fields of plugins, which may lay text around the
    prompt), or over the chat messages' text and then the rendered
    chat text (``--max-prompt-chars``)."""
    max_cache_salt_chars: int = 1024
    """Characters of ``cache_salt`` (``--max-cache-salt-chars``); it is hashed once per
    admitted sequence."""
    max_prompt_logprobs: int = 1_048_576
    """Prompt-logprob entries one request may ask for: its prompt tokens × (alternatives
    + 1) × ``n`` (``--max-prompt-logprobs``), counted after tokenization. Each entry is
    about 60 bytes of JSON, so the default bounds that part of a response near 64 MB."""
    max_body_bytes: int = 16_777_216
    """Bytes in one request body; a larger body is a 413 (``--max-body-bytes``)."""
    num_tokenizer_threads: int = 4
    """Worker threads that tokenize and render chat templates, off the event loop
    (``--tokenizer-threads``)."""
    idle_priority_chars: int = 16_384
    """A text of more characters than this is encoded by a background process at idle CPU
    priority, which runs only while the engine and the event loop leave a core free: a
    flood of long prompts waits instead of slowing the streams already running
    (``--idle-priority-chars``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f.name, f"{f.name} must be an integer ≥ 1, got {value!r}")

    def check_stop(self, stop: str | list[str] | None) -> None:
        """400 ``stop`` for too many stop strings or one too long."""
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise InvalidRequest("stop", f"at most {self.max_stop_strings} stop strings are "
                                         f"allowed, got {len(stops)}")
        for s in stops:
            if isinstance(s, str) and len(s) > self.max_stop_string_chars:
                raise InvalidRequest("stop", f"a stop string may have at most "
                                             f"{self.max_stop_string_chars} characters, got "
                                             f"{len(s)}")

    def check_cache_salt(self, salt: object) -> None:
        """400 ``cache_salt`` for a salt above ``max_cache_salt_chars`` characters (its type
        and emptiness are ``SamplingParams``' to check)."""
        if isinstance(salt, str) and len(salt) > self.max_cache_salt_chars:
            raise InvalidRequest("cache_salt", f"cache_salt may have at most "
                                               f"{self.max_cache_salt_chars} characters, got "
                                               f"{len(salt)}")

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """400 ``prompt`` for too many prompts, ``n`` for too many prompts × ``n``."""
        if num_prompts > self.max_prompts:
            raise InvalidRequest("prompt", f"at most {self.max_prompts} prompts are allowed "
                                           f"in one request, got {num_prompts}")
        if num_prompts * n > self.max_sequences:
            raise InvalidRequest("n", f"prompts × n is {num_prompts} × {n} = "
                                      f"{num_prompts * n}, above the {self.max_sequences} "
                                      f"sequences allowed in one request")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 ``param`` when ``num_chars`` of prompt text is above ``max_prompt_chars``."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequest(param, f"the prompt text has {num_chars} characters, above "
                                        f"the {self.max_prompt_chars} allowed before "
                                        f"tokenization")

    def check_prompt_logprobs(self, num_prompt_tokens: int, n: int, num_top: int,
                              param: str) -> None:
        """400 ``param`` when ``num_prompt_tokens × (num_top + 1) × n`` prompt-logprob entries
        are above ``max_prompt_logprobs``."""
        num = num_prompt_tokens * (num_top + 1) * n
        if num > self.max_prompt_logprobs:
            raise InvalidRequest(param, f"{param} asks for {num_prompt_tokens} prompt tokens × "
                                        f"{num_top + 1} logprobs × n={n} = {num} entries, above "
                                        f"the {self.max_prompt_logprobs} allowed in one request")

    def check_messages(self, messages: list[Any]) -> int:
        """The characters of the messages' text; 400 ``messages`` when they are above
        ``max_prompt_chars`` (counted before the template runs; the rendered text is checked
        again)."""
        total = 0
        for message in messages:
            content = message.content
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(part["text"]) for part in content if isinstance(part, dict)
                             and isinstance(part.get("text"), str))
            if message.name is not None:
                total += len(message.name)
        self.check_prompt_chars(total, "messages")
        return total


def count_prompts(prompt: str | list[Any]) -> tuple[int, int]:
    """``(number of prompts, characters of text prompts)`` of a completions ``prompt`` (str,
    [str], [int] or [[int]]), in O(number of prompts): the shape is validated later, with
    the tokenization, off the event loop."""
    if isinstance(prompt, str):
        return 1, len(prompt)
    if prompt and isinstance(prompt[0], (str, list)):
        return len(prompt), sum(len(part) for part in prompt if isinstance(part, str))
    return 1, 0


TOKENIZER_NICENESS = 10
"""Niceness of the tokenizer worker threads (Linux keeps it per thread): the engine process
and the event loop, at the normal priority, get most of a contended core."""


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: run at the normal priority


_ENCODER_SOURCE = r"""
import json, os, struct, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    try:
        os.nice(19)
    except OSError:
        pass
from tokenizers import Tokenizer
inp, out = sys.stdin.buffer, sys.stdout.buffer

def read():
    head = inp.read(4)
    if len(head) < 4:
        sys.exit(0)  # the server closed the pipe or is gone
    return inp.read(struct.unpack("<I", head)[0]).decode()

def write(obj):
    data = json.dumps(obj).encode()
    out.write(struct.pack("<I", len(data)) + data)
    out.flush()

tokenizer = Tokenizer.from_str(read())
while True:
    request = json.loads(read())
    try:
        write(tokenizer.encode(request[0], add_special_tokens=request[1]).ids)
    except Exception as exc:
        write({"error": f"{type(exc).__name__}: {exc}"})
"""
"""The idle-priority encoder: stdlib and ``tokenizers`` only (no torch, no FreeToken), one
length-prefixed JSON message per text and per answer over its stdin and stdout; it exits
when the server closes the pipe or dies."""


class IdleEncoder:
    """A child process at ``SCHED_IDLE`` priority that encodes with a copy of a fast
    tokenizer's Rust core (``tokenizer.backend_tokenizer``), one text at a time.

    ``encode`` blocks the calling thread (not the GIL) until the answer comes; it returns
    ``None`` when the process failed (it is then restarted on the next call), so the caller
    encodes in its own thread instead.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._config = backend.to_str()
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        process = subprocess.Popen([sys.executable, "-I", "-c", _ENCODER_SOURCE], env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(process, self._config)
        return process

    @staticmethod
    def _send(process: subprocess.Popen[bytes], text: str) -> None:
        assert process.stdin is not None
        data = text.encode()
        process.stdin.write(struct.pack("<I", len(data)) + data)
        process.stdin.flush()

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        with self._lock:
            try:
                if self._process is None:
                    self._process = self._start()
                self._send(self._process, json.dumps([text, add_special_tokens]))
                assert self._process.stdout is not None
                head = self._process.stdout.read(4)
                if len(head) < 4:
                    raise EOFError("the encoder process exited")
                answer = json.loads(self._process.stdout.read(struct.unpack("<I", head)[0]))
            except (OSError, EOFError, ValueError) as exc:
                log.warning("the idle-priority encoder process failed (%s); encoding in the "
                            "worker thread, a new process starts for the next long text", exc)
                self._stop()
                return None
        if isinstance(answer, dict):
            log.warning("the idle-priority encoder failed: %s", answer.get("error"))
            return None
        return answer

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()

    def close(self) -> None:
        """End the process (it would also exit on its own once this process is gone)."""
        with self._lock:
            self._stop()


class TokenizerPool:
    """Runs blocking tokenizer and template calls off the event loop.

    - Every call runs in one of ``num_threads`` worker threads at niceness
      ``TOKENIZER_NICENESS``.
    - A text of more than ``idle_priority_chars`` characters is encoded (``encode``) in a
      separate process with the ``SCHED_IDLE`` policy, which gets a core only when the engine
      and the server leave one free: a flood of long prompts waits for a free moment instead
      of taking CPU from the running streams (measured in ``bench/soak.py``'s ITL figure).
      It must be a process: a ``SCHED_IDLE`` *thread* of this process stalls the event loop
      whenever it needs the GIL back (CPython's GIL hand-off makes the releasing thread wait
      until the waiter has actually run, and on busy cores an idle-priority thread may not
      run for hundreds of milliseconds).

    The encoder process gets a copy of the fast tokenizer's Rust core
    (``tokenizer.backend_tokenizer``), so it encodes exactly as ``tokenizer.encode`` does; a
    tokenizer without one (a slow tokenizer) is encoded in the worker thread. Hugging Face's
    Rust core would otherwise hand even a single text to its own (Rayon) thread pool, at the
    normal priority: the pool sets ``TOKENIZERS_PARALLELISM=false`` (unless the environment
    already says otherwise) so encoding runs in the thread or process that was picked.
    Exceptions raised by the call (``InvalidRequest`` among them) propagate to the caller;
    if the encoder process fails, the text is encoded in the worker thread and a new process
    starts for the next long text.
    """

    def __init__(self, num_threads: int, idle_priority_chars: int = 16_384) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.num_threads = num_threads
        self.idle_priority_chars = idle_priority_chars
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="freetoken-tok",
                                            initializer=_lower_priority)
        self.idle_encoder: IdleEncoder | None = None

    def attach(self, tokenizer: Any) -> None:
        """Encode the long texts of ``tokenizer`` (the served one) in an idle-priority
        process, started on the first of them."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self.idle_encoder = IdleEncoder(backend)

    async def run(self, func: Callable[..., R], *args: Any) -> R:
        """``func(*args)`` in a worker thread; waits for a free one."""
        return await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                partial(func, *args))

    def encode(self, tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text)``; a text longer than ``idle_priority_chars`` goes to the
        idle-priority encoder process. Call it from a worker thread (it blocks)."""
        idle = self.idle_encoder
        if (len(text) > self.idle_priority_chars and idle is not None
                and getattr(tokenizer, "backend_tokenizer", None) is idle.backend):
            ids = idle.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.idle_encoder is not None:
            self.idle_encoder.close()
