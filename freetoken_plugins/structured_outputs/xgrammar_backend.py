"""The xgrammar backend of structured outputs (see ``backends`` for the contract).

xgrammar compiles eagerly: ``compile`` precomputes the token masks of the grammar's states
(tens to hundreds of milliseconds for a 49k vocabulary), after which a mask costs ~20 us.
xgrammar has no resource limits of its own; ``GrammarCompiler``'s timeout is the bound.
Its own compile cache is off: ``GrammarCompiler`` caches, with a bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xgrammar

from freetoken_core.lazy import lazy_import
from freetoken_plugins.structured_outputs.backends import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    TokenVocab,
    choice_grammar,
    invalid,
    num_bitmask_words,
)
from freetoken_plugins.structured_outputs.constraints import MAX_WHITESPACE, Constraint

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

__all__ = ["XGrammarBackend"]


class XGrammarBackend(GrammarBackend):
    """xgrammar behind the ``GrammarBackend`` interface; building one reads the vocabulary
    (~0.2 s for 49k tokens)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.vocab.eos_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, constraint: Constraint, param: str | None = None) -> CompiledGrammar:
        try:
            if constraint.kind == "json":
                # strict_mode: an object with properties and no additionalProperties takes
                # no other key (as close_objects does for llguidance).
                compiled = self._compiler.compile_json_schema(
                    constraint.spec, any_whitespace=not constraint.compact,
                    max_whitespace_cnt=None if constraint.compact else MAX_WHITESPACE,
                    strict_mode=constraint.additional_properties is False)
            elif constraint.kind == "regex":
                compiled = self._compiler.compile_regex(constraint.spec)
            elif constraint.kind == "grammar":
                compiled = self._compiler.compile_lark(constraint.spec)
            else:
                compiled = self._compiler.compile_lark(choice_grammar(constraint.spec))
        except (RuntimeError, ValueError) as exc:
            raise invalid(param, constraint, str(exc)) from None
        return CompiledGrammar(constraint, self.name, compiled)

    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        self._check_own(compiled)
        return _XGrammarMatcher(self.vocab, xgrammar.GrammarMatcher(compiled.handle))


class _XGrammarMatcher(Matcher):
    def __init__(self, vocab: TokenVocab, matcher: xgrammar.GrammarMatcher) -> None:
        super().__init__(vocab)
        self._matcher = matcher
        self._stopped: bool | None = None  # known until the next accepted token

    def is_accepting(self) -> bool:
        return bool(self._matcher.is_completed())

    def _accept_text(self, token_id: int) -> bool:
        accepted = bool(self._matcher.accept_token(token_id))
        if accepted:
            self._stopped = None
        return accepted

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def _is_stopped(self) -> bool:
        # xgrammar terminates only on a stop token, which the wrapper never passes it: a
        # complete match is stopped when no text token can extend it (one extra mask).
        if self._stopped is None:
            self._stopped = False
            if self._matcher.is_completed():
                scratch = torch.empty(1, num_bitmask_words(self._vocab.vocab_size),
                                      dtype=torch.int32)
                self._matcher.fill_next_token_bitmask(scratch, 0)
                self._stopped = not bool((scratch[0] & self._vocab.text_words).any())
        return self._stopped

    def _library_error(self) -> str | None:
        return None
