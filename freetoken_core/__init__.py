"""FreeToken: an LLM inference engine whose logits processors are plugins."""

from __future__ import annotations

from freetoken_core.config import EngineConfig
from freetoken_core.errors import FreeTokenError, InvalidRequest, ModelLoadError
from freetoken_core.hookspecs import hookimpl
from freetoken_core.llm import LLM
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
