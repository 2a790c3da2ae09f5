"""The llguidance backend of structured outputs (see ``backends`` for the contract).

llguidance builds its lexer and parser lazily: ``compile`` validates the grammar and builds a
template matcher in milliseconds; each request's matcher is a deep copy of the template
(microseconds). A mask then costs ~0.1-0.3 ms for a 49k vocabulary, bounded by llguidance's
default ``LLParserLimits`` (a grammar past them stops its matcher, with an ``error()``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import llguidance.hf
from llguidance import LLMatcher

from freetoken_core.lazy import lazy_import
from freetoken_plugins.structured_outputs.backends import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    TokenVocab,
    choice_grammar,
    invalid,
)
from freetoken_plugins.structured_outputs.constraints import (
    MAX_WHITESPACE,
    Constraint,
    close_objects,
)

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

__all__ = ["LLGuidanceBackend"]

_WHITESPACE = {"whitespace_flexible": True,
               "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}
"""At most ``MAX_WHITESPACE`` characters of JSON whitespace between two tokens."""
_COMPACT = {"whitespace_flexible": False}

LOWEST_INTEGER = -(2**63) + 2**16
"""llguidance 1.9 crashes its process (SIGSEGV) on a JSON-schema ``enum``/``const`` integer
within a few hundred of -2**63, in a schema or a Lark ``%json`` block: such integers (with
a wide margin) are refused before it sees them."""
_NEGATIVE_INTEGER = re.compile(r"-\s*0*(\d{19,})(?![\d.eE])")


class LLGuidanceBackend(GrammarBackend):
    """llguidance behind the ``GrammarBackend`` interface; building one wraps the tokenizer
    (~0.4 s for a 49k vocabulary)."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(self.vocab.eos_ids))

    def compile(self, constraint: Constraint, param: str | None = None) -> CompiledGrammar:
        if constraint.kind in ("json", "grammar"):
            for match in _NEGATIVE_INTEGER.finditer(constraint.spec):
                if -int(match.group(1)) < LOWEST_INTEGER:
                    raise invalid(param, constraint, f"an integer below -(2**63 - 2**16) "
                                  f"(-{match.group(1)}) is not supported by the llguidance "
                                  "backend")
        if constraint.kind == "json":
            # llguidance has no option for undeclared keys: the schema says it (as vLLM does).
            spec = (constraint.spec if constraint.additional_properties is not False
                    else json.dumps(close_objects(json.loads(constraint.spec))))
            try:
                grammar = LLMatcher.grammar_from_json_schema(
                    spec, overrides=_COMPACT if constraint.compact else _WHITESPACE)
            except ValueError as exc:
                raise invalid(param, constraint, str(exc)) from None
        elif constraint.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(constraint.spec)
        elif constraint.kind == "grammar":
            grammar = LLMatcher.grammar_from_lark(constraint.spec)
        else:
            grammar = LLMatcher.grammar_from_lark(choice_grammar(constraint.spec))
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise invalid(param, constraint, error)
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise invalid(param, constraint, template.get_error())
        return CompiledGrammar(constraint, self.name, template)

    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        self._check_own(compiled)
        return _LLGuidanceMatcher(self.vocab, compiled.handle.deep_copy())


class _LLGuidanceMatcher(Matcher):
    def __init__(self, vocab: TokenVocab, matcher: LLMatcher) -> None:
        super().__init__(vocab)
        self._matcher = matcher

    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    def _accept_text(self, token_id: int) -> bool:
        # consume_token of a refused token would leave the matcher in its error state for good.
        return (self._matcher.validate_tokens([token_id]) == 1
                and self._matcher.consume_token(token_id))

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        # Matcher.fill_bitmask checked the layout (CPU, int32, contiguous, the row's width).
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def _is_stopped(self) -> bool:
        return bool(self._matcher.is_stopped())

    def _library_error(self) -> str | None:
        return self._matcher.get_error() or None
