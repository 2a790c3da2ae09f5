"""FreeToken: an LLM inference engine whose logits processors are plugins."""

from __future__ import annotations

from freetoken_core.config import EngineConfig
from freetoken_core.errors import FreeTokenError, InvalidRequest, ModelLoadError
from freetoken_core.hookspecs import hookimpl
from freetoken_core.outputs import CompletionOutput, RequestOutput
from freetoken_core.processors import (
    AnswerStart,
    ChatView,
    ChoiceView,
    Implied,
    LogitsProcessor,
    ModelInfo,
    Plugin,
    ProcessorContext,
    PromptView,
    RequestFields,
    RequestView,
    ResponseFields,
    ResponseView,
    Stage,
    StopView,
)
from freetoken_core.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AnswerStart",
    "ChatView",
    "ChoiceView",
    "CompletionOutput",
    "EngineConfig",
    "FreeTokenError",
    "Implied",
    "InvalidRequest",
    "LogitsProcessor",
    "ModelInfo",
    "ModelLoadError",
    "Plugin",
    "ProcessorContext",
    "PromptView",
    "RequestFields",
    "RequestOutput",
    "RequestView",
    "ResponseFields",
    "ResponseView",
    "SamplingParams",
    "Stage",
    "StopView",
    "hookimpl",
]


def __getattr__(name: str) -> object:
    # LLM on first use: it brings the engine, the models and torch, which the HTTP process
    # of `freetoken serve` (and a plugin that imports only this package's names) does not need.
    if name == "LLM":
        from freetoken_core.llm import LLM

        return LLM
    raise AttributeError(f"module 'freetoken_core' has no attribute {name!r}")
