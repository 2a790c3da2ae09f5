"""Grammar backends: compile a ``Constraint`` for one tokenizer, then match tokens against it.

One interface, two implementations (``make_backend``): llguidance (the default, in
``llguidance_backend``) and xgrammar (``xgrammar_backend``).
A backend is built once per model from its Hugging Face fast tokenizer, the model's
``vocab_size`` (the logits' width, which may exceed ``len(tokenizer)``) and its EOS ids.

What every matcher guarantees, whatever the backend (the wrapper enforces it on top of the
library, so a backend quirk cannot leak through):

* special tokens (bos, ``<|im_start|>``, FIM tokens ...) are never allowed, not even when a
  Lark grammar names one (xgrammar would let them spell their text inside a JSON string);
* ids ``>= len(tokenizer)`` (padding of the model's vocabulary) are never allowed;
* an EOS id is allowed exactly when the text so far is a complete match (``is_accepting``);
* a rejected token leaves the matcher as it was;
* a matcher with nothing left to allow (EOS accepted, a dead end, a library error) is
  terminated and its bitmask allows only EOS, so a masked logits row is never all ``-inf``.

Backend differences (the same ``Constraint`` may compile on one and not the other):

* ``json``: llguidance refuses keywords it does not implement (``not``, ...) with an
  ``InvalidRequest``; xgrammar ignores them. Both take undeclared keys as the constraint's
  ``additional_properties`` says (``False``: an object schema with ``properties`` and no
  ``additionalProperties`` takes no other key: xgrammar's ``strict_mode``, for llguidance
  ``close_objects`` rewrites the schema; ``True``: the schema read literally). Both allow
  at most ``MAX_WHITESPACE`` whitespace characters between tokens (none when ``compact``;
  their fixed separators then differ: llguidance ``,`` and ``:``, xgrammar ``, `` and
  ``: ``). A backend is given a resolved ``additional_properties`` (never ``None``).
  xgrammar 0.2.9 mishandles a string with ``minLength`` /
  ``maxLength`` (mlc-ai/xgrammar#800, open): it allows raw control characters (invalid
  JSON) and no escapes there; ``pattern`` bounds are not affected.
* ``regex``: llguidance takes Rust ``regex`` syntax, xgrammar an ECMAScript-like subset;
  neither supports lookaround or backreferences. Both match the whole output.
* ``grammar``: Lark text on both (xgrammar >= 0.2 compiles Lark; its older EBNF entry point
  is not used). Each supports its own Lark extensions (llguidance: ``%json``, ``%regex``,
  ``max_tokens``; xgrammar: ``%import common``, ``%json``); plain Lark rules, terminals,
  regexes and repetition work on both. The start rule is ``start``.
* ``choice``: compiled on both as the Lark grammar ``start: "a" | "b" ...``.
* llguidance treats every added token as special, so a non-special added token such as
  ``<think>`` never spells text there; xgrammar lets it spell its text.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken_core.errors import InvalidRequest
from freetoken_core.lazy import lazy_import
from freetoken_plugins.structured_outputs.constraints import Constraint
from freetoken_plugins.structured_outputs.mask import pack_bitmask

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

__all__ = ["BACKENDS", "CompiledGrammar", "GrammarBackend", "Matcher", "TokenVocab",
           "make_backend", "num_bitmask_words"]

BACKENDS: tuple[str, ...] = ("llguidance", "xgrammar")
"""The names ``make_backend`` accepts; the first is the default."""

_MAX_MESSAGE_CHARS = 300
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def num_bitmask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row for ``vocab_size`` tokens: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True, eq=False)
class TokenVocab:
    """What a backend knows of the model's tokens, and the masks that enforce the contract.

    ``special_ids`` are the tokenizer's special tokens and the EOS ids; ``text_words`` is a
    bitmask row allowing every other id below ``len(tokenizer)``; ``eos_words`` allows the
    EOS ids. A fill is ANDed with ``text_words``, then the EOS bits are set or cleared.
    """

    vocab_size: int
    num_tokens: int
    eos_ids: tuple[int, ...]
    special_ids: frozenset[int]
    text_words: torch.Tensor
    eos_words: torch.Tensor

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int,
                       eos_token_ids: Sequence[int]) -> TokenVocab:
        """Raises ``ValueError`` when ``vocab_size < len(tokenizer)`` (llguidance refuses such
        a vocabulary) or an EOS id is not a tokenizer id."""
        num_tokens = len(tokenizer)
        if vocab_size < num_tokens:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{num_tokens} tokens")
        eos_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if not eos_ids or not all(0 <= i < num_tokens for i in eos_ids):
            raise ValueError(f"eos_token_ids must be tokenizer ids, got {eos_token_ids!r}")
        special = set(tokenizer.all_special_ids)
        special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        text = torch.zeros(1, vocab_size, dtype=torch.bool)
        text[0, :num_tokens] = True
        text[0, sorted(special | set(eos_ids))] = False
        eos = torch.zeros(1, vocab_size, dtype=torch.bool)
        eos[0, list(eos_ids)] = True
        return cls(vocab_size, num_tokens, eos_ids, frozenset(special | set(eos_ids)),
                   pack_bitmask(text)[0], pack_bitmask(eos)[0])

    def is_text(self, token_id: int) -> bool:
        """Whether ``token_id`` may spell constrained text (not special, not padding)."""
        return 0 <= token_id < self.num_tokens and token_id not in self.special_ids


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled by one backend for one tokenizer. Immutable and shareable
    between threads and matchers; only the backend named ``backend`` can open matchers on it
    (``handle`` is that library's object)."""

    constraint: Constraint
    backend: str
    handle: Any


class Matcher(abc.ABC):
    """The state of one generation under one grammar; one thread at a time.

    Subclasses make the library calls (``_accept_text``, ``_fill``, ``is_accepting``,
    ``_is_stopped``, ``_library_error``); this class enforces the module's guarantees.
    """

    def __init__(self, vocab: TokenVocab) -> None:
        self._vocab = vocab
        self._eos_accepted = False
        self._dead_end = False  # the library allowed only special tokens

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id`` and return True, or return False and change nothing when
        it is not allowed here: special, padding and out-of-range ids never; an EOS id once,
        when ``is_accepting()`` or ``is_terminated()``; nothing after an EOS."""
        if self._eos_accepted:
            return False
        if token_id in self._vocab.eos_ids:
            self._eos_accepted = self.is_accepting() or self.is_terminated()
            return self._eos_accepted
        return (not self.is_terminated() and self._vocab.is_text(token_id)
                and self._accept_text(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write into ``bitmask[row]`` the tokens allowed next. ``bitmask`` is a CPU int32
        tensor [rows, num_bitmask_words(vocab_size)], contiguous (``ValueError`` otherwise).
        A terminated matcher allows only EOS, even when not accepting (a dead end or a
        library error: the generation must end, and a row must never be all ``-inf``)."""
        words = num_bitmask_words(self._vocab.vocab_size)
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2
                or bitmask.shape[1] != words or not bitmask.is_contiguous()):
            raise ValueError(f"bitmask must be a contiguous CPU int32 tensor [rows, {words}], "
                             f"got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
        target = bitmask[row]
        if not self.is_terminated():
            self._fill(bitmask, row)
            target &= self._vocab.text_words
            if self.is_accepting():
                target |= self._vocab.eos_words
            else:
                self._dead_end = not bool(target.any())
        if self.is_terminated():
            target.copy_(self._vocab.eos_words)

    def is_terminated(self) -> bool:
        """Whether generation must end: nothing but EOS may follow, or EOS was accepted."""
        return self._eos_accepted or self._dead_end or self._is_stopped()

    def error(self) -> str | None:
        """Why the matcher ended without a complete match (a dead end or a library error,
        such as a resource limit), or ``None``."""
        if self._dead_end:
            return "the grammar allows only special tokens here"
        return self._library_error()

    @abc.abstractmethod
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match, so EOS is allowed now."""

    @abc.abstractmethod
    def _accept_text(self, token_id: int) -> bool:
        """Advance past the text token ``token_id``, or return False leaving the state."""

    @abc.abstractmethod
    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the library's bitmask for the next token into ``bitmask[row]``."""

    @abc.abstractmethod
    def _is_stopped(self) -> bool:
        """Whether the library says nothing but EOS may follow."""

    @abc.abstractmethod
    def _library_error(self) -> str | None:
        """The library's error message, if it stopped the matcher."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer and opens matchers on them. ``compile`` may run
    on several threads at once; a matcher belongs to the thread that uses it."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, eos_token_ids)

    @abc.abstractmethod
    def compile(self, constraint: Constraint, param: str | None = None) -> CompiledGrammar:
        """Compile ``constraint``; raises ``InvalidRequest(param, ...)`` when its schema, regex
        or grammar is invalid or unsupported by this backend."""

    @abc.abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        """A fresh matcher at the start of ``compiled`` (which this backend made)."""

    def _check_own(self, compiled: CompiledGrammar) -> None:
        if compiled.backend != self.name:
            raise ValueError(f"a grammar compiled by {compiled.backend} given to {self.name}")


def choice_grammar(choices_json: str) -> str:
    """The Lark grammar of a ``choice`` spec: ``start: "a" | "b"``, JSON-escaped literals."""
    choices = json.loads(choices_json)
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def invalid(param: str | None, constraint: Constraint, detail: str) -> InvalidRequest:
    """The ``InvalidRequest`` for a constraint a library refused, with its first line."""
    detail = (detail.strip().splitlines() or ["unknown error"])[0]
    detail = _XGRAMMAR_LOG_PREFIX.sub("", detail)
    if len(detail) > _MAX_MESSAGE_CHARS:
        detail = detail[:_MAX_MESSAGE_CHARS - 3] + "..."
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
            "grammar": "Lark grammar"}[constraint.kind]
    return InvalidRequest(param, f"invalid {what}: {detail}")


def make_backend(name: str, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> GrammarBackend:
    """The backend ``name`` (one of ``BACKENDS``) for this tokenizer; ``ValueError`` for an
    unknown name. Building one costs ~0.2-0.4 s for a 49k vocabulary: build it once."""
    # Imported here: each library loads only when its backend is chosen.
    if name == "llguidance":
        from freetoken_plugins.structured_outputs.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from freetoken_plugins.structured_outputs.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"unknown structured-outputs backend {name!r}; expected one of "
                     f"{', '.join(BACKENDS)}")
