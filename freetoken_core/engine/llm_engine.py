"""The engine in one process: engine core plus tokenization and text output."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_core.config import EngineConfig, EngineLimits
from freetoken_core.engine import generation_defaults
from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.core import EngineCore
from freetoken_core.engine.generation_defaults import GenerationDefaults
from freetoken_core.engine.memory import keep_freed_memory
from freetoken_core.engine.model_runner import KvCache, ModelRunner, kv_cache_shape
from freetoken_core.engine.output_processor import RequestState
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.scheduler import Scheduler
from freetoken_core.engine.tensor_parallel import TensorParallelGroup, start_group
from freetoken_core.errors import InvalidRequest, ModelLoadError
from freetoken_core.models.block_layout import INT24_TYPES
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_reader import file_bytes
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.llama import LlamaForCausalLM
from freetoken_core.models.loader import load_model, return_freed_memory
from freetoken_core.models.resolve import gguf_source, resolve_model
from freetoken_core.models.sharding import Shard
from freetoken_core.outputs import RequestOutput
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, ProcessorContext, PromptView
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.tokenizer import load_tokenizer

log = logging.getLogger("freetoken.engine")


def eos_token_ids(model_dir: Path, cfg: ModelConfig, tokenizer: Any) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def compute_limits(config: EngineConfig, cfg: ModelConfig, eos: frozenset[int]) -> EngineLimits:
    """The run-time limits: ``kv_cache_tokens // block_size`` whole blocks, and a context
    capped by the slots those blocks hold (a longer sequence could never get its blocks
    and would preempt itself forever), by a sliding window and by ``max_model_len``."""
    num_blocks = config.kv_cache_tokens // config.block_size
    max_len = config.max_model_len or cfg.max_position_embeddings
    if cfg.sliding_window:
        # Sliding-window attention is not implemented; within the window it is exact.
        max_len = min(max_len, cfg.sliding_window)
    max_len = min(max_len, num_blocks * config.block_size)
    return EngineLimits(max_len, num_blocks, config.block_size, cfg.vocab_size, eos)


@dataclass
class EngineParts:
    """A built engine: what ``LLMEngine`` and the engine process of ``freetoken serve``
    share. ``core`` owns the model and the KV cache; the rest describes the model."""

    core: EngineCore
    tokenizer: Any
    model_info: ModelInfo
    plugins: PluginManager
    model_dir: Path
    model_config: ModelConfig
    limits: EngineLimits
    generation_defaults: GenerationDefaults
    """What requests that leave a field unset get (``--generation-config``)."""
    group: TensorParallelGroup | None = None
    """The other ranks of a tensor-parallel engine (``close()`` them when done)."""


def build_engine(config: EngineConfig, progress: bool = True,
                 plugins: PluginManager | None = None) -> EngineParts:
    """Resolve and load the model named by ``config`` and wire the engine core to the
    enabled plugins' processors and stop hooks. Raises ``ModelLoadError``,
    ``PluginSelectionError`` or ``GenerationConfigError`` with a message for the operator."""
    plugins = (plugins if plugins is not None
               else PluginManager(config.plugins, config.plugin_options))
    plugins.enabled  # noqa: B018 (fail fast on an unknown plugin name)
    keep_freed_memory()
    model_dir = resolve_model(config.model, progress=progress)
    model_config = ModelConfig.from_dir(model_dir, config.hf_overrides)
    device = config.torch_device()
    # One rank: the KV cache's shape is known now (compute_limits' whole blocks), and its
    # write overlaps the tokenizer's, the plugins' and the model's loading (a GGUF file's
    # weights, about its size, checked to fit beside it).
    gguf = gguf_source(config.model)
    kv_layers, kv_heads, head_dim = kv_cache_dims(model_config)
    kv_cache = None if config.tensor_parallel_size > 1 else KvCache(
        kv_cache_shape(kv_layers, config.kv_cache_tokens // config.block_size,
                       config.block_size, kv_heads, head_dim),
        config.kv_torch_dtype(device), device, config.kv_cache_prefault,
        weights_bytes=file_bytes(gguf) if gguf is not None else 0)
    tokenizer = load_tokenizer(model_dir, config.chat_template_text())
    generation_config = generation_defaults.read(config, model_dir,
                                                 gguf is not None)
    limits = compute_limits(config, model_config,
                            eos_token_ids(model_dir, model_config, tokenizer)
                            | generation_config.eos_token_ids())
    model_info = ModelInfo(limits.vocab_size, limits.eos_token_ids, limits.max_model_len)
    defaults = generation_defaults.resolve(generation_config, plugins, model_info)
    pipeline = ProcessorPipeline(plugins.processor_classes(), ProcessorContext(
        config.max_num_seqs, model_info, device, tokenizer, plugins.options, plugins.hook))
    group = start_group(config) if config.tensor_parallel_size > 1 else None
    try:
        model = load_engine_model(config, model_dir, limits,
                                  None if group is None else group.shard)
        runner = ModelRunner(model, limits.num_kv_blocks, limits.block_size,
                             config.kv_torch_dtype(device), device, pipeline,
                             prefault=config.kv_cache_prefault, kv_cache=kv_cache,
                             state_slots=config.max_num_seqs)
        if group is not None:
            group.wait_ready()
            runner.send_plan = group.send_plan
    except BaseException:
        if group is not None:
            group.close()
        raise
    # A model with recurrent layers keeps a state per sequence that a prefix-cache hit
    # would skip computing: its prefix cache is off.
    prefix_caching = config.enable_prefix_caching and not runner.recurrent
    if config.enable_prefix_caching and runner.recurrent:
        log.warning("prefix caching is off for %s: its recurrent layers' state cannot be "
                    "taken from cached blocks", model_config.architecture)
    block_manager = BlockManager(limits.num_kv_blocks, limits.block_size, prefix_caching)
    # The core keeps processor state in step with the scheduler's slots (and fails a
    # request whose plugin raises while it is admitted).
    scheduler = Scheduler(
        block_manager, config.max_num_seqs, config.max_num_batched_tokens,
        on_admit=lambda seq: core.admit(seq), on_release=lambda seq: core.release(seq))
    core = EngineCore(runner, scheduler, limits, pipeline, plugins.stop_hooks())
    return EngineParts(core, tokenizer, model_info, plugins, model_dir, model_config, limits,
                       defaults, group)


def load_engine_model(config: EngineConfig, model_dir: Path, limits: EngineLimits,
                      shard: Shard | None = None) -> LlamaForCausalLM:
    """``config``'s model (this rank's part of it where ``shard`` is given), its linears
    switched to the activations ``config`` asks for."""
    device = config.torch_device()
    model = load_model(model_dir, config.torch_dtype(device), device, limits.max_model_len,
                       gguf_source(config.model), shard=shard,
                       overrides=config.hf_overrides)
    if config.activations == "q8":
        kept = model.use_q8_activations()
        if kept:
            log.warning("--activations q8: %d linear(s) have no 8-bit kernel and keep the "
                        "float32 one: %s", len(kept), ", ".join(sorted(set(kept))))
    elif config.activations in ("auto", "int24"):
        switched = model.use_int24_activations()
        return_freed_memory()  # the re-layout's temporaries, which the heap would keep
        disagreed = model.check_amx_tiles() if switched else None
        if disagreed:
            log.warning("AMX tiles off: %s; the int24 kernel computes every row count on "
                        "AVX-512 VNNI (the same floats, slower from 8 rows)", disagreed)
        if not switched and config.activations == "int24":
            raise ModelLoadError(
                "--activations int24 needs a GGUF model with weights of the int24 kernel's types "
                f"({'/'.join(INT24_TYPES.values())}), dtype float32, on a CPU with AVX-512 VNNI "
                "and the native kernels "
                f"(here: GGUF blocks {model.uses_gguf_blocks}, native {model.native})")
    return model


class LLMEngine:
    """Loads the model named by ``config`` and runs requests through the engine core.

    ``step()`` advances every live request by one scheduling step and returns the
    ``RequestOutput`` of each request that changed, finished ones included.
    """

    def __init__(self, config: EngineConfig, progress: bool = True,
                 plugins: PluginManager | None = None) -> None:
        self.config = config
        parts = build_engine(config, progress, plugins)
        self.plugins = parts.plugins
        self.model_dir = parts.model_dir
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.model_info = parts.model_info
        self.limits = parts.limits
        self.core = parts.core
        self.generation_defaults = parts.generation_defaults
        self.generation_defaults.log(log)
        self.group = parts.group
        self._requests: dict[str, RequestState] = {}

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing otherwise); the engine
        cannot step afterwards. They also die with this process."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> None:
        """Fill the fields ``params`` leaves unset from the generation defaults (into a new
        object: ``params`` is the caller's), validate (the plugins' fields too), let
        ``freetoken_rewrite_prompt`` lay out the prompt, tokenize it and queue the request."""
        params = self.generation_defaults.apply(params)
        params.verify(self.model_info)
        self.plugins.validate(params, self.model_info)
        prompt = self.plugins.rewrite_prompt(PromptView(prompt, params, self.tokenizer))
        if isinstance(prompt, str):
            text, token_ids = prompt, self.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequest("prompt", "a prompt is a string or a list of token ids")
        self.core.add_request(request_id, token_ids, params)
        self._requests[request_id] = RequestState(request_id, text, token_ids, params,
                                                  self.tokenizer)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self._requests.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Outputs of the requests that changed. A request that failed inside the engine
        (a plugin raised, the model step failed) comes back finished, its open choices
        with ``finish_reason="error"`` and ``RequestOutput.error`` saying why."""
        changed: dict[str, RequestOutput] = {}
        for update in self.core.step():
            state = self._requests.get(update.request_id)
            if state is None:
                continue
            stop = state.apply(update)
            if stop is not None and update.finish_reason is None:
                self.core.stop_sequence(update.request_id, update.index, stop)
            changed[update.request_id] = state.output
        for request_id, error in self.core.take_failures():
            state = self._requests.get(request_id)
            if state is not None:
                state.fail(str(error))
                changed[request_id] = state.output
        for request_id, output in changed.items():
            if output.finished:
                del self._requests[request_id]
        return list(changed.values())
