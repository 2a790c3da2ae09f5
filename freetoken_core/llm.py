"""The offline Python API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Self

from freetoken_core.config import EngineConfig
from freetoken_core.engine.llm_engine import LLMEngine
from freetoken_core.errors import InvalidRequest
from freetoken_core.outputs import RequestOutput
from freetoken_core.sampling_params import SamplingParams

Prompt = str | list[int]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """A model loaded in this process. ``model=None`` is the embedded default model.

    Engine options (``dtype``, ``max_model_len``, ``max_num_seqs``, ``kv_cache_tokens``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``device``) are
    those of ``EngineConfig``. ``generation_config`` (``"auto"``, the default: the model
    directory's ``generation_config.json``; ``"none"``; or a path) and
    ``override_generation_config`` (a dict winning over the file key by key) give defaults
    to the fields a ``SamplingParams`` leaves unset (``SamplingParams()`` sets none;
    ``SamplingParams(temperature=1.0)`` sets the temperature); ``engine.generation_defaults``
    shows them. A bad default raises ``GenerationConfigError`` here.
    ``tensor_parallel_size=N`` splits the model over N processes (``close()`` or a ``with``
    block stops them).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        progress = engine_options.pop("progress", True)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), progress=progress)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a ``tensor_parallel_size > 1`` engine (they also die
        with this process); nothing otherwise."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequest("sampling_params",
                                     "give one SamplingParams or one per prompt")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
            results: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests:
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [results[i] for i in ids]
