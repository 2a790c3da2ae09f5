"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetoken_core.errors import InvalidRequest, ModelLoadError

# Prompt tokens decoded before the first output token, so that tokenizers which drop a
# leading space at the start of a decode (SentencePiece) keep the output's spacing.
_CONTEXT_TOKENS = 5


# The tokenizer classes that are transformers' generic fast tokenizer (transformers 5 names
# it TokenizersBackend, 4 PreTrainedTokenizerFast; the one is an alias of the other in 5).
_GENERIC_FAST = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model_dir: Path, chat_template: str | None = None) -> Any:
    """The model directory's Hugging Face fast tokenizer.

    A directory FreeToken converted from a GGUF file declares the generic fast class, which
    is what AutoTokenizer returns for it; it is loaded as that class directly, without
    AutoTokenizer's detour through the model's config (in transformers 5 that imports
    LlamaConfig's module and with it torch.distributed: 5.9 s against 1.4 s on the reference
    machine, paid by the engine and the HTTP process at every start). Other directories go
    through AutoTokenizer, which knows the model-specific classes. ``chat_template`` (the
    text of ``--chat-template``) replaces the model's template."""
    try:
        if _is_generic_conversion(model_dir):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _is_generic_conversion(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a conversion in FreeToken's cache whose tokenizer is the
    generic fast class (and no remote code)."""
    import json

    from freetoken_core.config import cache_dir

    try:
        model_dir = model_dir.resolve()
        if not model_dir.is_relative_to((cache_dir() / "models").resolve()):
            return False
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in _GENERIC_FAST
            and "auto_map" not in config and (model_dir / "tokenizer.json").is_file())


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        **template_kwargs: Any) -> str:
    """Render ``messages`` with the model's chat template; 400 when there is none."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", "this model has no chat template; start the server "
                                         "with --chat-template FILE")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **template_kwargs)


def direct_decoder(tokenizer: Any) -> Callable[..., str]:
    """``tokenizer.decode``, or the decode of its Rust backend (``tokenizers.Tokenizer``)
    when that gives the same text: a fast tokenizer that does not clean up tokenization
    spaces adds nothing to it but argument conversion, which costs more than the decode
    of a few tokens (the detokenizer of every stream runs it twice per token)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = getattr(tokenizer, "is_fast", False) and callable(getattr(backend, "decode", None))
    if fast and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    It decodes a small window of tokens around the newest ones and emits only the part of
    the text that no later token can change; a window that ends in an incomplete UTF-8
    sequence (U+FFFD) waits for more tokens. ``finish()`` flushes what is left.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = direct_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text[len(prefix):]

    def finish(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
