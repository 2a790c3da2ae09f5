"""Engine configuration: what the operator chose (frozen) and what was found at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken_core.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

_CACHE_ENV = "FREETOKEN_CACHE"


def cache_dir() -> Path:
    """FreeToken's cache root: ``$FREETOKEN_CACHE`` if set (and non-empty), else the per-user
    cache directory from :func:`platformdirs.user_cache_dir`. It may not exist yet."""
    override = os.environ.get(_CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("freetoken"))


# By name: torch is imported where a dtype is needed (the engine), not by the HTTP process.
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("auto", "float32", "int24", "q8")


def _is_template_text(text: str) -> bool:
    return "{{" in text or "{%" in text


@dataclass(frozen=True)
class EngineConfig:
    """Options of ``LLM(...)`` and ``freetoken serve``; validated on construction.

    ``dtype="auto"`` is float32 on CPU (on this project's reference CPU, bf16 GEMMs at
    batch >= 8 run 2-10x slower than float32; see bench/engine.py) and bfloat16 on CUDA.
    ``max_model_len=None`` takes the model's ``max_position_embeddings`` (capped by the KV
    cache). ``kv_cache_tokens`` sizes the paged KV cache in tokens; the cache holds
    ``kv_cache_tokens // block_size`` whole blocks (a remainder is not allocated), and the
    effective ``max_model_len`` is capped at the slots of those blocks
    (``num_kv_blocks * block_size``), so a request that passes the length check always fits
    in the cache on its own: ``kv_cache_tokens=100, block_size=16`` serves 96-token contexts.
    ``block_size`` is also the prefix cache's grain: requests that share a prefix reuse its
    whole blocks and recompute the rest of it (on average half a block each). 8 rather than
    vLLM's 16: the chat template's 24-token system prompt of the default model is three
    whole blocks instead of one and a half, and a 16-sequence batch of bench/engine.py's
    chat prompts prefilled in 180 ms instead of 280-300; decode steps measured the same at
    ~50 and ~1,000 tokens of context (docs/operations.md).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    kv_cache_tokens: int = 32768
    kv_cache_prefault: bool = True
    """Write the whole KV cache once when the engine starts (CPU), so that its memory is
    resident before the first request (as llama.cpp's cleared KV buffer and vLLM's reserved
    GPU cache are) instead of faulting in during decode steps: the block manager hands out
    never-used blocks before it evicts cached ones, so a lazily mapped cache keeps faulting
    until every block has been written once (on the 2-core Zen 5 VM, whose fresh memory is
    slow to touch, 16 sequences of the SmolLM2 Q4_0 file decoded in 15.7 ms steps lazily
    and 14.1 prefaulted; docs/operations.md, "GGUF memory"). The cost is at start, 1-5 s a
    GiB there, on a thread of its own while the tokenizer, plugins and model load
    (``KvCache``). ``False`` (``--no-kv-cache-prefault``): zero pages until written."""
    kv_cache_dtype: str = "auto"
    """How the KV cache stores keys and values: ``auto`` (default) the model's dtype
    (``dtype``: float32 on CPU, so the default arithmetic stays exact), or ``float32``,
    ``float16`` (llama.cpp's default, half float32's bytes), ``bfloat16``. Attention reads
    the stored values and sums in float32 either way; a 16-bit cache rounds each key and
    value once when it is written (every path, prefill and decode alike, attends to the
    rounded ones), so it is not exact against transformers' float32."""
    block_size: int = 8
    enable_prefix_caching: bool = True
    plugins: str | None = None
    """Plugins to enable: "all" (default, also when None and FREETOKEN_PLUGINS is unset),
    "none", or a comma-separated list of entry-point names."""
    plugin_options: dict[str, Any] = field(default_factory=dict)
    """The parsed command-line options (``vars(args)``), plugins' own options included:
    they reach processors as ``ProcessorContext.options`` and plugins through
    ``freetoken_configure``, in every process."""
    generation_config: str | os.PathLike[str] = "auto"
    """Where request defaults come from: ``auto`` (the model directory's
    ``generation_config.json``, when it has one), ``none``, or a path (a directory holding
    ``generation_config.json``, or the file itself)."""
    override_generation_config: dict[str, Any] | None = field(default_factory=dict)
    """Generation-config keys that win over the file's, key by key."""
    hf_overrides: dict[str, Any] | None = None
    """Keys that replace the model's ``config.json`` keys (vLLM's ``--hf-overrides``), for a
    directory or a GGUF file alike, e.g. Qwen's YaRN long-context setting
    ``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}``."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the model's (or gives one to a model without):
    the path of a file, or the template itself (text holding ``{{`` or ``{%``)."""
    activations: str = "auto"
    """How the CPU linears of a GGUF model multiply. Exact (token-identical to transformers
    in float32): ``float32`` (the file's weights dequantized to float32, float32 FMAs) or
    ``int24`` (each block of 32 activations in 24-bit fixed point, exact integer dot products
    on AVX-512 VNNI / AMX: the same size of rounding as float32's, far fewer instructions;
    the Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4
    linears, the others (F32, F16, BF16, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
    IQ1_M) keep float32; needs a CPU with AVX-512 VNNI); ``auto`` (default) takes int24
    where the CPU has it, else float32. Opt-in, not exact: ``q8`` (llama.cpp's arithmetic:
    activations quantized to 8 bits per block of 32, per 256 for the K-quants; the Q4_0,
    Q4_1, Q5_0, Q8_0, Q4_K and Q6_K linears, the others keep float32; bench/q8_quality.py
    measures it)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (``sharding``): one process each, rank 0 the engine's;
    docs/operations.md's "Past one machine"."""
    distributed_executor_backend: str = "mp"
    """How the other ranks start: ``mp`` (processes started by rank 0 on its node; the
    ranks of other nodes by ``freetoken serve --headless`` there) or ``ray`` (one Ray
    actor per rank in a placement group of the running Ray cluster)."""
    nnodes: int = 1
    """Nodes the ranks are spread over (``mp``); ``tensor_parallel_size / nnodes`` ranks
    each."""
    node_rank: int = 0
    """This node's index (0: the node that serves HTTP)."""
    master_addr: str = "127.0.0.1"
    """Where rank 0's rendezvous listens (``torch.distributed``'s TCP store)."""
    master_port: int = 0
    """Its port; 0 picks a free one (one node only)."""
    pin_ranks: bool = True
    """Each tensor-parallel rank of a node on CPUs of its own, one torch thread per CPU
    (``--pin-threads``; where the node has at least as many CPUs as ranks)."""
    distributed_timeout: float = 60.0
    """Seconds a rank waits for another in one collective (or for the group to form)
    before the group counts as broken; a rank that dies is noticed within a second."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidRequest(name, f"{name}: {message}")

        check(self.dtype == "auto" or self.dtype in DTYPES, "dtype",
              f"must be auto or one of {', '.join(DTYPES)}")
        check(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device",
              "must be auto, cpu or cuda[:N]")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
              "must be >= 1")
        check(self.kv_cache_dtype == "auto" or self.kv_cache_dtype in DTYPES, "kv_cache_dtype",
              f"must be auto or one of {', '.join(DTYPES)}")
        check(self.activations in ACTIVATIONS, "activations",
              f"must be one of {', '.join(ACTIVATIONS)}")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.block_size >= 1, "block_size", "must be >= 1")
        check(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
              "must hold at least one block")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        check(self.distributed_executor_backend in ("mp", "ray"),
              "distributed_executor_backend", "must be mp or ray")
        check(self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0, "nnodes",
              "must be >= 1 and divide tensor_parallel_size")
        check(0 <= self.node_rank < self.nnodes, "node_rank", "must be in 0..nnodes-1")
        check(0 <= self.master_port < 65536, "master_port", "must be a port (0: a free one)")
        check(self.nnodes == 1 or self.master_port > 0, "master_port",
              "must be given when nnodes > 1")
        check(self.distributed_timeout > 0, "distributed_timeout", "must be > 0")
        if isinstance(self.generation_config, os.PathLike):
            object.__setattr__(self, "generation_config", os.fspath(self.generation_config))
        if self.override_generation_config is None:
            object.__setattr__(self, "override_generation_config", {})
        check(self.chat_template is None or (isinstance(self.chat_template, str) and (
            _is_template_text(self.chat_template) or Path(self.chat_template).is_file())),
            "chat_template", "must be a Jinja template or the path of a file holding one")
        check(isinstance(self.generation_config, str) and bool(self.generation_config),
              "generation_config", "must be auto, none or a path")
        check(self.hf_overrides is None or (isinstance(self.hf_overrides, dict) and all(
            isinstance(k, str) for k in self.hf_overrides)),
            "hf_overrides", "must be a JSON object (a dict with str keys)")
        check(isinstance(self.override_generation_config, dict)
              and all(isinstance(k, str) for k in self.override_generation_config),
              "override_generation_config", "must be a JSON object (a dict with str keys)")

    def chat_template_text(self) -> str | None:
        """``chat_template`` read: the template itself (``None`` if not set)."""
        if self.chat_template is None or _is_template_text(self.chat_template):
            return self.chat_template
        return Path(self.chat_template).read_text(encoding="utf-8")

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def kv_torch_dtype(self, device: torch.device) -> torch.dtype:
        """The KV cache's dtype: ``kv_cache_dtype``, or the model's for ``auto``."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype(device)
        return getattr(torch, self.kv_cache_dtype)


@dataclass(frozen=True)
class EngineLimits:
    """Values discovered at start-up from the model and the cache; never written back."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
