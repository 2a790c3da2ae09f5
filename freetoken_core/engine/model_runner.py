"""The one owner of tensors and the device: KV cache, model forward, sampling, prompt
logprobs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from freetoken_core import hugepages
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from freetoken_core.engine.scheduler import ScheduledBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata, SequenceSpans
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.llama import LlamaForCausalLM
from freetoken_core.outputs import PromptLogprobs

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions whose logits are computed at once for prompt logprobs, so a step's extra
memory is a small multiple of this many rows × the vocabulary in float32 (256 × 49,152
floats are 48 MiB), whatever the size of its prefill chunks."""


@dataclass
class StepResult:
    """The sequences that reached the end of their tokens this step and what they drew;
    ``prefilled``: those that reached it but generate nothing (``max_tokens == 0``), so drew
    nothing; ``prompt_logprobs``: the logprobs of the prompt positions this step scored,
    per sequence that collects them (``Sequence.prompt_logprobs``)."""

    seqs: list[Sequence]
    output: SamplerOutput
    prefilled: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, PromptLogprobs]] = field(default_factory=list)


@dataclass
class _Scoring:
    """The prompt positions a step scores: flat rows of the step's hidden states, the prompt
    token each row predicts, and how many rows each scoring sequence has, in order."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    seqs: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, first_row: int, start: int, num: int) -> None:
        """Score ``seq``'s prompt positions among the ``num`` it computes from ``start``
        (flat row ``first_row``): those not scored yet, up to the last but one. ``seq``
        collects prompt logprobs."""
        assert seq.prompt_logprobs is not None
        lo = max(start, len(seq.prompt_logprobs))
        hi = min(start + num, seq.num_prompt_tokens - 1)
        if lo < hi:
            self.rows.extend(range(first_row + lo - start, first_row + hi - start))
            self.targets.extend(seq.token_ids[lo + 1:hi + 1])
            self.seqs.append((seq, hi - lo))


class StepPlan(msgspec.Struct, array_like=True):
    """A step's model inputs: what ``run_plan`` computes, and what rank 0 sends the other
    ranks of a tensor-parallel group each step (lists of ints, not sequences)."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    """Per sequence, in step order (decodes first): its cache blocks, keys after the step,
    and tokens in the step."""
    logits_rows: list[list[int] | None]
    """The hidden-state rows of each ``compute_logits`` call, in order (``None``: all)."""
    state_slots: list[int] = msgspec.field(default_factory=list)
    """Per sequence, its scheduler slot, where a model with recurrent layers keeps its state
    (empty for the others)."""


def run_plan(model: LlamaForCausalLM, kv_caches: torch.Tensor, plan: StepPlan,
             block_size: int, device: torch.device) -> list[torch.Tensor]:
    """Run ``plan``'s forward pass and its logits calls; the logits of each call, in order
    (on the other ranks of a tensor-parallel group: empty ones)."""
    meta = AttentionMetadata.build(plan.block_tables, plan.context_lens, plan.query_lens,
                                   block_size, device, native=model.native)
    if plan.state_slots:
        meta.sequences = SequenceSpans.build(plan.context_lens, plan.query_lens,
                                             plan.state_slots, device)
    ids, pos = torch.tensor([plan.input_ids, plan.positions], dtype=torch.long, device=device)
    hidden = model.forward(ids, pos, kv_caches, meta)
    return [model.compute_logits(hidden if rows is None else hidden[
        torch.tensor(rows, dtype=torch.long, device=device)]) for rows in plan.logits_rows]


def _check_kv_fits(shape: tuple[int, ...], dtype: torch.dtype, weights_bytes: int = 0) -> None:
    """A KV cache to be written at start that the memory available cannot hold beside the
    model's weights (``weights_bytes``, about to be loaded: a GGUF file's size): a clear
    error now, naming the cache size that fits, rather than the kernel's OOM killer while
    the cache or the weights are written (a 30B MoE file of 19.5 GB and the default
    32,768-token cache, 6 GiB for it in float32, on a 24 GiB machine)."""
    nbytes = hugepages.tensor_bytes(shape, dtype)
    available = hugepages.available_bytes()
    if available is None or nbytes + weights_bytes <= available:
        return
    weights = (f" and the model's weights ~{weights_bytes / 2**30:.1f} GiB" if weights_bytes
               else "")
    fit = int((available - weights_bytes) * 0.9 / (nbytes / shape[1])) // 1024 * 1024
    hint = f" (about {fit:,} fit)" if fit > 0 else " (the weights alone do not fit)"
    raise ModelLoadError(
        f"the KV cache of {shape[1]:,} token slots ({shape[0]} layers, {dtype}) takes "
        f"{nbytes / 2**30:.1f} GiB{weights}, more than the {available / 2**30:.1f} GiB of "
        f"memory available; lower --kv-cache-tokens{hint}")


def kv_cache_shape(num_layers: int, num_kv_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """[layer, slot, key/value, kv head, head dim]: a slot's key and value are adjacent."""
    return (num_layers, num_kv_blocks * block_size, 2, num_kv_heads, head_dim)


class KvCache:
    """The KV cache, allocated (and on CPU written once, ``prefault``) on a thread of its own
    from construction, so that the write overlaps the rest of the engine's start (the
    tokenizer, the plugins, the model): the default model's 1.4 GiB took 1.1 s of a 2.6 s
    build on the Zen 5 VM, on the critical path before. A cache the memory cannot hold is
    refused here, at once. ``tensor()`` waits for it (and raises what the thread raised)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 prefault: bool = True, weights_bytes: int = 0) -> None:
        """``weights_bytes``: the memory the model's weights are about to take beside the
        cache (checked with it)."""
        self.shape = shape
        self._tensor: torch.Tensor | None = None
        self._error: BaseException | None = None
        if device.type == "cpu" and prefault:
            _check_kv_fits(shape, dtype, weights_bytes)

        def allocate() -> None:
            try:
                # zeros, not empty: padded decode rows read stale slots under a mask, and
                # NaN garbage would poison the masked softmax.
                if device.type == "cpu":
                    # In huge pages: attention reads each sequence's blocks wherever they
                    # lie. Prefaulted: resident before the first step.
                    self._tensor = hugepages.zeros(shape, dtype, populate=prefault)
                else:
                    self._tensor = torch.zeros(shape, dtype=dtype, device=device)
            except BaseException as exc:  # noqa: BLE001 (raised again by tensor())
                self._error = exc

        self._thread = threading.Thread(target=allocate, name="freetoken-kv-cache", daemon=True)
        self._thread.start()

    def tensor(self) -> torch.Tensor:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._tensor is not None
        return self._tensor


class ModelRunner:
    """Builds a step's flat inputs from the scheduled batch, runs the model, samples, and
    scores the prompt positions of the sequences that collect prompt logprobs (and only
    theirs: a step without them computes logits for the sampled rows alone).

    ``kv_cache``: the cache started early (``KvCache``, of this model's shape), else one is
    made here."""

    def __init__(self, model: LlamaForCausalLM, num_kv_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device,
                 pipeline: ProcessorPipeline | None = None, prefault: bool = True,
                 kv_cache: KvCache | None = None, state_slots: int = 1) -> None:
        """``state_slots``: the scheduler's slots (``max_num_seqs``), for a model that keeps
        a recurrent state per running sequence (``model.recurrent``)."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        layers, heads, dim = kv_cache_dims(cfg, model.num_kv_heads)
        shape = kv_cache_shape(layers, num_kv_blocks, block_size, heads, dim)
        if kv_cache is None:
            kv_cache = KvCache(shape, kv_dtype, device, prefault)
        if kv_cache.shape != shape:
            raise ValueError(f"a KV cache of shape {kv_cache.shape} for a model that needs "
                             f"{shape}")
        self.kv_caches = kv_cache.tensor()
        self.recurrent = bool(getattr(model, "recurrent", False))
        if self.recurrent:
            model.allocate_states(state_slots)
        self.sampler = Sampler(pipeline)
        self.send_plan: Callable[[StepPlan], None] | None = None
        """Tensor parallelism: hands each step's plan to the other ranks before it runs."""

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        # Decoding sequences first: attention handles them in one batched call.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Sequence] = []
        prefilled: list[Sequence] = []
        scoring = _Scoring()
        for seq, num in zip(seqs, counts):
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                scoring.add(seq, len(input_ids), start, num)
            input_ids.extend(seq.token_ids[start:start + num])
            positions.extend(range(start, start + num))
            if start + num == seq.num_tokens:
                if seq.max_tokens == 0:
                    prefilled.append(seq)
                else:
                    sample_rows.append(len(input_ids) - 1)
                    sampling.append(seq)
        logits_rows: list[list[int] | None] = [
            scoring.rows[i:i + PROMPT_LOGPROBS_ROWS]
            for i in range(0, len(scoring.rows), PROMPT_LOGPROBS_ROWS)]
        if sampling:  # every row samples (decoding): all of the hidden states
            logits_rows.append(None if len(sample_rows) == len(input_ids) else sample_rows)
        plan = StepPlan(input_ids, positions, [s.block_table for s in seqs],
                        [s.num_computed_tokens + n for s, n in zip(seqs, counts)], counts,
                        logits_rows, [s.slot for s in seqs] if self.recurrent else [])
        if self.send_plan is not None:
            self.send_plan(plan)
        logits = run_plan(self.model, self.kv_caches, plan, self.block_size, self.device)
        prompt_logprobs = (self._score_prompts(logits[:len(logits) - bool(sampling)], scoring)
                           if scoring.seqs else [])
        if not sampling:
            return StepResult([], SamplerOutput([], []), prefilled, prompt_logprobs)
        output = self.sampler(logits[-1], SamplingBatch.from_seqs(sampling, self.device))
        return StepResult(sampling, output, prefilled, prompt_logprobs)

    def _score_prompts(self, chunks: list[torch.Tensor], scoring: _Scoring
                       ) -> list[tuple[Sequence, PromptLogprobs]]:
        """Logprob, rank and top alternatives of each scored row's next prompt token, from
        float32 log-softmax over the logits of ``PROMPT_LOGPROBS_ROWS`` rows at a time
        (``chunks``)."""
        num_top = max(seq.params.prompt_logprobs or 0 for seq, _ in scoring.seqs)
        scored = PromptLogprobs()
        for i, chunk in zip(range(0, len(scoring.rows), PROMPT_LOGPROBS_ROWS), chunks):
            rows = scoring.rows[i:i + PROMPT_LOGPROBS_ROWS]
            targets = torch.tensor(scoring.targets[i:i + PROMPT_LOGPROBS_ROWS],
                                   dtype=torch.long, device=self.device).unsqueeze(1)
            lp = chunk.log_softmax(dim=-1)  # float32
            chosen = lp.gather(1, targets)
            scored.logprobs.extend(chosen.squeeze(1).tolist())
            scored.ranks.extend(((lp > chosen).sum(dim=-1) + 1).tolist())
            if num_top:
                values, top_ids = lp.topk(num_top, dim=-1)
                scored.top_ids.extend(top_ids.tolist())
                scored.top_logprobs.extend(values.tolist())
            else:
                scored.top_ids.extend([] for _ in range(len(rows)))
                scored.top_logprobs.extend([] for _ in range(len(rows)))
        out, offset = [], 0
        for seq, num in scoring.seqs:
            end, width = offset + num, seq.params.prompt_logprobs or 0
            out.append((seq, PromptLogprobs(
                scored.logprobs[offset:end], scored.ranks[offset:end],
                [ids[:width] for ids in scored.top_ids[offset:end]],
                [values[:width] for values in scored.top_logprobs[offset:end]])))
            offset = end
        return out
