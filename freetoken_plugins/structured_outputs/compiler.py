"""Compile constraints off the caller's thread, once per distinct constraint, within a time.

``GrammarCompiler`` wraps a ``GrammarBackend`` with a thread pool and an LRU cache keyed by
the ``Constraint`` (kind, spec and options). The cache holds futures, so a constraint is compiled once however many
requests ask for it at the same time, and an invalid one is refused from the cache without
compiling again. Both outcomes count toward the same bound (``cache_entries``); a compile
that failed for another reason than an invalid constraint (a library bug, memory) is not
kept, so a retry compiles again.

Timeouts: ``compile`` waits at most ``timeout_s`` and then refuses the request. Python cannot
stop a thread, so the compile keeps running on its worker and stays cached while it runs:
identical requests wait on it rather than start another, and if it finishes, later ones use
its result. While ``num_threads`` such compiles run, new ones queue behind them (and may time
out without having started). llguidance bounds its own work (``LLParserLimits``); xgrammar
does not, so with xgrammar this timeout is the only bound.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict

from freetoken_core.affinity import release_thread
from freetoken_core.errors import InvalidRequest
from freetoken_plugins.structured_outputs.backends import CompiledGrammar, GrammarBackend
from freetoken_plugins.structured_outputs.constraints import Constraint

__all__ = ["DEFAULT_CACHE_ENTRIES", "DEFAULT_NUM_THREADS", "DEFAULT_TIMEOUT_S",
           "GrammarCompiler"]

DEFAULT_NUM_THREADS = 2
"""Compiles that run at once; each may hold a core for as long as it takes."""
DEFAULT_TIMEOUT_S = 10.0
"""How long a request waits for its grammar before it is refused (HTTP 400)."""
DEFAULT_CACHE_ENTRIES = 256
"""Compiled (or refused) constraints kept; the least recently used goes first."""

_Key = Constraint


class GrammarCompiler:
    """Compiles constraints with ``backend`` on ``num_threads`` worker threads, caching up to
    ``cache_entries`` outcomes; ``compile`` waits at most ``timeout_s`` (see the module
    docstring). Thread-safe. ``ValueError`` for a non-positive setting."""

    def __init__(self, backend: GrammarBackend, num_threads: int = DEFAULT_NUM_THREADS,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        if num_threads < 1 or not timeout_s > 0 or cache_entries < 1:
            raise ValueError(f"GrammarCompiler needs num_threads >= 1, timeout_s > 0 and "
                             f"cache_entries >= 1, got {num_threads}, {timeout_s}, "
                             f"{cache_entries}")
        self.backend = backend
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        # Started from the engine's main thread: off its CPU (freetoken_core.affinity).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="grammar-compile", initializer=release_thread)
        self._cache: OrderedDict[_Key, concurrent.futures.Future[CompiledGrammar]] = (
            OrderedDict())
        self._lock = threading.Lock()

    def submit(self, constraint: Constraint) -> concurrent.futures.Future[CompiledGrammar]:
        """The future of ``constraint``'s compiled grammar: the cached one, or a new compile.
        An invalid constraint's future raises ``InvalidRequest`` with ``param`` None;
        ``compile`` names the field."""
        key = constraint
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.backend.compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_unexpected(key, done))
        return future

    def compile(self, constraint: Constraint, param: str) -> CompiledGrammar:
        """``constraint``'s compiled grammar, waiting at most ``timeout_s``. Raises
        ``InvalidRequest(param, ...)`` when the constraint is invalid or its compile takes
        longer (the compile goes on in the background; see the module docstring)."""
        future = self.submit(constraint)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequest(param, f"the {constraint.kind} constraint took longer than "
                                 f"{self.timeout_s:g} s to compile") from None
        except InvalidRequest as exc:
            raise InvalidRequest(param, exc.message) from None

    def num_cached(self) -> int:
        """How many constraints the cache holds (compiled, refused or still compiling)."""
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Stop taking work and drop queued compiles; running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_unexpected(self, key: _Key,
                           done: concurrent.futures.Future[CompiledGrammar]) -> None:
        if not done.cancelled():
            error = done.exception()
            if error is None or isinstance(error, InvalidRequest):
                return
        with self._lock:
            if self._cache.get(key) is done:
                del self._cache[key]
