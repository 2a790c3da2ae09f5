"""From token updates to text: incremental detokenization and stop strings."""

from __future__ import annotations

from typing import Any

from freetoken_core.engine.core import SeqUpdate
from freetoken_core.outputs import CompletionOutput, RequestOutput
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.tokenizer import IncrementalDetokenizer


class ChoiceText:
    """The text of one choice, with stop strings held back until they can no longer match.

    ``text`` is everything decided so far; ``released`` is the part a client may see (the
    last ``len(longest stop) - 1`` characters wait while a stop string could still start
    there). A matched stop string ends the text, kept only with
    ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                  params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.released = ""

    def add(self, token_id: int, finished: bool) -> str | None:
        """Append a token; return the stop string it completed, if any."""
        delta = self.detokenizer.add([token_id])
        if finished:
            delta += self.detokenizer.finish()
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        matched = self._find_stop(search_from)
        end = len(self.text) if finished or matched else len(self.text) - self.hold
        if end > len(self.released):
            self.released = self.text[:end]
        return matched

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + (len(stop) if self.include_stop else 0)]
        return stop


class RequestState:
    """Everything the frontend tracks for one request while it runs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any) -> None:
        self.params = params
        self.texts = [ChoiceText(tokenizer, prompt_token_ids, params) for _ in range(params.n)]
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
