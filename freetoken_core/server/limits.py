"""Bounds on the work one HTTP request may ask for, and the threads that tokenize.

``RequestLimits`` is part of ``ServerConfig`` (one ``freetoken serve`` flag per field; the
defaults and flags are listed in ``docs/operations.md``). Its ``check_*`` methods raise
``InvalidRequest`` naming the request field (``stop``, ``prompt``, ``n``, ``messages``), so
every violation is a 400 before any tokenizer, template or engine work starts. The body
size is enforced by Litestar (``request_max_body_size``: 413).

``TokenizerPool`` runs tokenization and chat-template rendering in worker threads, so that
a long prompt does not stall the event loop that streams every other request.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, TypeVar

from freetoken_core.errors import InvalidRequest

R = TypeVar("R")


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
    max_body_bytes: int = 16_777_216
    """Bytes in one request body; a larger body is a 413 (``--max-body-bytes``)."""
    num_tokenizer_threads: int = 4
    """Worker threads that tokenize and render chat templates, off the event loop
    (``--tokenizer-threads``)."""
    idle_priority_chars: int = 16_384
    """Prompt text of more characters than this is tokenized by one background thread at
    idle CPU priority, which runs only while the engine and the event loop leave a core
    free: a flood of long prompts waits instead of slowing the streams already running
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


def _idle_priority() -> None:
    """``SCHED_IDLE`` for this thread: the kernel runs it only on a core that nothing of
    normal priority wants (niceness alone still takes a third of a core from a two-thread
    matmul on two cores; ``SCHED_IDLE`` takes nothing measurable)."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        _lower_priority()  # not Linux, or not allowed: niceness at least


class TokenizerPool:
    """Runs blocking tokenizer and template calls off the event loop.

    - Work on up to ``idle_priority_chars`` characters runs in ``num_threads`` worker threads
      at niceness ``TOKENIZER_NICENESS``.
    - Longer work runs in one more thread with the ``SCHED_IDLE`` policy: while the engine
      keeps every core busy, a long prompt waits for a free moment instead of taking CPU
      from the running streams (measured in ``bench/soak.py``'s ITL figure).

    Hugging Face fast tokenizers release the GIL while they encode, so the event loop keeps
    streaming meanwhile; templates (Jinja) hold it, but only in switch-interval slices.
    Their Rust core would otherwise hand even a single text to its own (Rayon) thread pool,
    at the normal priority: the pool sets ``TOKENIZERS_PARALLELISM=false`` (unless the
    environment already says otherwise) so the encoding runs in the calling thread, at that
    thread's priority. Exceptions raised by the call (``InvalidRequest`` among them)
    propagate to the caller.
    """

    def __init__(self, num_threads: int, idle_priority_chars: int = 16_384) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.num_threads = num_threads
        self.idle_priority_chars = idle_priority_chars
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="freetoken-tok",
                                            initializer=_lower_priority)
        self._idle = ThreadPoolExecutor(1, thread_name_prefix="freetoken-tok-idle",
                                        initializer=_idle_priority)

    async def run(self, func: Callable[..., R], *args: Any, num_chars: int = 0) -> R:
        """``func(*args)`` in a worker thread; waits for a free one. ``num_chars`` (the
        prompt text the call works on) above ``idle_priority_chars`` picks the idle-priority
        thread."""
        executor = self._idle if num_chars > self.idle_priority_chars else self._executor
        return await asyncio.get_running_loop().run_in_executor(executor, partial(func, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._idle.shutdown(wait=False, cancel_futures=True)
