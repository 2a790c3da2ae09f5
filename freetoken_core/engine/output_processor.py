"""From token updates to text: incremental detokenization and stop strings.

Stop strings are matched by one Aho–Corasick automaton per request (``StopMatcher``),
shared by the request's choices and fed only each token's new characters, so the cost per
token is O(new text) whatever the number of stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from freetoken_core.outputs import CompletionOutput, RequestOutput, prompt_logprob_dicts
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from freetoken_core.engine.core import SeqUpdate

_CHAR_BITS = 21  # every code point is below 0x110000 = 2**21


class StopMatcher:
    """An Aho–Corasick automaton over a fixed set of stop strings, built once.

    The automaton is immutable and may be shared by any number of texts (a request's
    choices); each text keeps its own ``state`` (an int, ``0`` at the start) and feeds
    ``feed`` only its new characters. Building costs O(total length of the stops); feeding
    costs amortized O(1) per character.

    Which stop wins: the one that *completes first* in the text; of those completing on the
    same character, the one that *starts first* (the longest). This depends only on the
    text, never on how it was split into tokens.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises ``ValueError`` for an empty stop string (it would match everywhere)."""
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.max_len = max((len(s) for s in stops), default=0)
        # Trie edges in one flat dict keyed by ``node << 21 | code point`` (far smaller than
        # one dict per node for large stop sets).
        goto: dict[int, int] = {}
        depth, parent, char, terminal = [0], [0], [0], [False]
        for stop in self.stops:
            node, i = 0, 0
            while i < len(stop):  # down the part of the trie this stop shares
                child = goto.get((node << _CHAR_BITS) | ord(stop[i]))
                if child is None:
                    break
                node, i = child, i + 1
            if i < len(stop):  # the rest is one new chain of nodes, added in bulk
                first, codes = len(depth), [ord(ch) for ch in stop[i:]]
                chain = range(first, first + len(codes))
                parents = [node, *chain[:-1]]
                goto.update(zip([(p << _CHAR_BITS) | c for p, c in zip(parents, codes)], chain))
                depth.extend(range(depth[node] + 1, depth[node] + 1 + len(codes)))
                parent.extend(parents)
                char.extend(codes)
                terminal.extend([False] * len(codes))
                node = chain[-1]
            terminal[node] = True
        fail = [0] * len(depth)
        # ``longest[n]``: the length of the longest stop that ends node n's string
        # (0 if none): n itself when terminal, else what its failure link ends in.
        longest = [0] * len(depth)
        for node in sorted(range(1, len(depth)), key=depth.__getitem__):
            if depth[node] > 1:
                fail[node] = self._step(goto, fail, fail[parent[node]], char[node])
            longest[node] = depth[node] if terminal[node] else longest[fail[node]]
        self._goto, self._fail, self._longest = goto, fail, longest

    @staticmethod
    def _step(goto: dict[int, int], fail: list[int], state: int, code: int) -> int:
        while True:
            nxt = goto.get((state << _CHAR_BITS) | code)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Advance ``state`` over ``text``; stop at the first character that completes a
        stop string. Returns ``(state, end, length)``: ``text[end]`` is the last character
        of the winning stop, which is ``length`` characters long (it may begin in text fed
        earlier); ``end == -1`` and ``length == 0`` when none completed."""
        goto, fail, longest = self._goto, self._fail, self._longest
        for end, ch in enumerate(text):
            code = ord(ch)
            while True:  # ``_step`` inlined: this loop runs once per generated character
                nxt = goto.get((state << _CHAR_BITS) | code)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if longest[state]:
                return state, end, longest[state]
        return state, -1, 0


class ChoiceText:
    """The text of one choice, with stop strings held back until they can no longer match.

    ``text`` is everything decided so far; ``released`` is the part a client may see (the
    last ``len(longest stop) - 1`` characters wait while a stop string could still start
    there). A matched stop string ends the text, kept only with
    ``include_stop_str_in_output``; which stop wins is ``StopMatcher``'s rule. Once a stop
    matched, ``add`` ignores further tokens. ``matcher`` is the request's shared automaton
    over ``params.stop`` (built here when not given).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams, matcher: StopMatcher | None = None) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                  params.skip_special_tokens)
        self.matcher = matcher if matcher is not None else StopMatcher(params.stop)
        if self.matcher.stops != tuple(params.stop):
            raise ValueError("the matcher was built for other stop strings")
        self.include_stop = params.include_stop_str_in_output
        self.hold = max(self.matcher.max_len, 1) - 1
        self.text = ""
        self.released = ""
        self.is_stopped = False
        self._state = 0

    def add(self, token_id: int, finished: bool) -> str | None:
        """Append a token; return the stop string it completed, if any."""
        if self.is_stopped:
            return None
        delta = self.detokenizer.add([token_id])
        if finished:
            delta += self.detokenizer.finish()
        matched = None
        if self.matcher.stops and delta:
            self._state, end, length = self.matcher.feed(self._state, delta)
            if length:
                full = self.text + delta[:end + 1]  # the text after the stop is dropped
                matched = full[len(full) - length:]
                self.text = full if self.include_stop else full[:len(full) - length]
                self.is_stopped = True
        if matched is None:
            self.text += delta
        end = len(self.text) if finished or matched else len(self.text) - self.hold
        if end > len(self.released):
            self.released = self.text[:end]
        return matched


class RequestState:
    """Everything the frontend tracks for one request while it runs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any) -> None:
        self.params = params
        self.tokenizer = tokenizer
        matcher = StopMatcher(params.stop)
        self.texts = [ChoiceText(tokenizer, prompt_token_ids, params, matcher)
                      for _ in range(params.n)]
        self.output = RequestOutput(
            request_id, prompt, prompt_token_ids, 0,
            [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
             for i in range(params.n)])

    def apply(self, update: SeqUpdate) -> str | None:
        """Fold one update in; return a stop string that now ends the choice, if any."""
        choice = self.output.outputs[update.index]
        text = self.texts[update.index]
        self.output.num_cached_tokens = max(self.output.num_cached_tokens,
                                            update.num_cached_tokens)
        if update.prompt_logprobs is not None:
            self.output.prompt_logprobs = prompt_logprob_dicts(
                self.output.prompt_token_ids, update.prompt_logprobs, self._decode_alone)
        if update.token_id is None:  # a choice that generates nothing ends here
            choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
            return None
        choice.token_ids.append(update.token_id)
        if choice.logprobs is not None and update.logprobs is not None:
            choice.logprobs.append(update.logprobs)
        matched = text.add(update.token_id, update.finish_reason is not None)
        if matched is not None:
            choice.finish_reason, choice.stop_reason = "stop", matched
        elif update.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
        choice.text = text.released
        return matched

    def _decode_alone(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def fail(self, message: str) -> None:
        """The engine failed the request: every open choice ends with ``"error"``."""
        self.output.error = message
        for choice in self.output.outputs:
            if choice.finish_reason is None:
                choice.finish_reason = "error"
