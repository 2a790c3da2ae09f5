"""Logprob entries rendered in the two OpenAI shapes.

A token's text is the tokenizer's decoding of that token alone (special tokens kept), and
``bytes`` is that text in UTF-8; a token that holds part of a multi-byte character
therefore reads as U+FFFD, as in vLLM. Logprobs are those of the model's raw distribution
(before processors and temperature; see ``Sampler``).
"""

from __future__ import annotations

from typing import Any

from freetoken_core.outputs import PromptLogprobs, prompt_logprob_dicts
from freetoken_core.server import protocol as p
from freetoken_core.server.generation import LogprobEntry


class LogprobFormatter:
    """Renders entries for one request; ``completion`` keeps each choice's running
    ``text_offset`` so that streamed pieces carry offsets into the whole text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._offsets: dict[int, int] = {}

    def token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def completion(self, index: int, entries: list[LogprobEntry]) -> p.CompletionLogprobs:
        """``{tokens, token_logprobs, top_logprobs, text_offset}``; each ``top_logprobs``
        dict holds the asked-for alternatives plus the sampled token (as OpenAI does), or
        is ``null`` with the logprob for the first token of an echoed prompt."""
        offset = self._offsets.get(index, 0)
        tokens, values, tops, offsets = [], [], [], []
        for token_id, logprob, top in entries:
            text = self.token(token_id)
            tokens.append(text)
            values.append(logprob)
            alternatives = None
            if logprob is not None:
                alternatives = {self.token(t): v for t, v in top or []}
                alternatives.setdefault(text, logprob)
            tops.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return p.CompletionLogprobs(tokens, values, tops, offsets)

    def prompt(self, prompt_token_ids: list[int], scored: PromptLogprobs,
               num_top: int) -> p.PromptLogprobsList:
        """vLLM's ``prompt_logprobs`` with ``num_top`` alternatives per position."""
        return [None if entry is None else
                {str(token_id): p.PromptTokenLogprob(lp.logprob, lp.rank, lp.decoded_token)
                 for token_id, lp in entry.items()}
                for entry in prompt_logprob_dicts(prompt_token_ids, scored, self.token,
                                                  num_top)]

    def chat(self, entries: list[LogprobEntry]) -> p.ChatLogprobs:
        """``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
        with exactly the asked-for number of alternatives, most likely first."""
        content = []
        for token_id, logprob, top in entries:
            text = self.token(token_id)
            alternatives = [p.TopLogprob(self.token(t), v, list(self.token(t).encode()))
                            for t, v in top]
            content.append(p.ChatTokenLogprob(text, logprob, list(text.encode()), alternatives))
        return p.ChatLogprobs(content)


def echo_entries(prompt_token_ids: list[int], scored: PromptLogprobs,
                 num_top: int) -> list[LogprobEntry]:
    """The completions logprob entries of an echoed prompt: the first token without a
    logprob, then each token with ``num_top`` alternatives."""
    first: LogprobEntry = (prompt_token_ids[0], None, None)
    return [first, *((token_id, logprob, list(zip(ids[:num_top], values[:num_top])))
                     for token_id, logprob, ids, values in zip(
                         prompt_token_ids[1:], scored.logprobs, scored.top_ids,
                         scored.top_logprobs))]
