"""The one owner of tensors and the device: KV cache, model forward, sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from freetoken_core.engine.scheduler import ScheduledBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.llama import LlamaForCausalLM


@dataclass
class StepResult:
    """The sequences that reached the end of their tokens this step and what they drew."""

    seqs: list[Sequence]
    output: SamplerOutput


class ModelRunner:
    """Builds a step's flat inputs from the scheduled batch, runs the model, samples."""

    def __init__(self, model: LlamaForCausalLM, num_kv_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device,
                 pipeline: ProcessorPipeline | None = None) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_kv_blocks * block_size
        # zeros, not empty: padded decode rows read stale slots under a mask, and NaN
        # garbage would poison the masked softmax.
        # [layer, slot, key/value, kv head, head dim]: a slot's key and value are adjacent.
        self.kv_caches = torch.zeros(cfg.num_layers, num_slots, 2, cfg.num_kv_heads,
                                     cfg.head_dim, dtype=dtype, device=device)
        self.sampler = Sampler(pipeline)

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
        for seq, num in zip(seqs, counts):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + num])
            positions.extend(range(start, start + num))
            if start + num == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        meta = AttentionMetadata.build(
            [s.block_table for s in seqs],
            [s.num_computed_tokens + n for s, n in zip(seqs, counts)],
            counts, self.block_size, self.device, native=self.model.native)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        if not sampling:
            return StepResult([], SamplerOutput([], []))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        output = self.sampler(logits, SamplingBatch.from_seqs(sampling, self.device))
        return StepResult(sampling, output)
