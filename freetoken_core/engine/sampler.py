"""The sampler: logits processors, greedy / temperature / top-k / top-p, seeded draws,
logprobs.

Randomness is counter-based: each row draws one uniform number from a hash of
``(seed, number of tokens the sequence has generated)``, then picks its token by inverse
CDF over its own (filtered) distribution. A row's token therefore depends only on its own
logits, seed and position, never on what else shares the batch, and a preempted sequence
that is recomputed draws the same tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sequence import Sequence
from freetoken_core.outputs import INVALID_TOKEN, NO_TOKEN, TokenLogprobs

_MASK_53 = (1 << 53) - 1


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row from splitmix64 of (seed, counter); vectorised."""
    x = seeds * -7046029254386353131 + counters  # golden-ratio increment
    x = x ^ _shr(x, 30)
    x = x * -4658895280553007687
    x = x ^ _shr(x, 27)
    x = x * -7723592293110705685
    x = x ^ _shr(x, 31)
    return (_shr(x, 11) & _MASK_53).double() / float(1 << 53)


@dataclass
class SamplingBatch:
    """The sampler's view of the rows that sample this step, as device tensors."""

    slots: torch.Tensor
    """[B] the processor-state slot of each row."""
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    filter_rows: torch.Tensor | None
    """Rows with top-k or top-p (only they pay for the sort), or None."""
    max_top_k: int
    max_logprobs: int
    num_logprobs: list[int | None]
    slot_list: list[int]
    """``slots`` as Python ints (for the processors' host-side work)."""

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        params = [s.params for s in seqs]
        # One notion of greedy everywhere: ``is_greedy`` (temperature below
        # GREEDY_TEMPERATURE), written as 0.0 so that the tensor agrees with it.
        greedy = [p.is_greedy for p in params]
        temps = [0.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        top_p = [p.top_p for p in params]
        top_k = [p.top_k for p in params]
        num_logprobs = [p.logprobs for p in params]
        filter_rows = [i for i, (g, p) in enumerate(zip(greedy, params))
                       if not g and (p.top_p < 1.0 or p.top_k > 0)]

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            slots=t([s.slot or 0 for s in seqs], torch.long),  # None: outside an engine
            temperature=t(temps, torch.float32),
            top_p=t(top_p, torch.float32),
            top_k=t(top_k, torch.long),
            seeds=t([s.seed for s in seqs], torch.long),
            counters=t([s.num_output_tokens for s in seqs], torch.long),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            filter_rows=t(filter_rows, torch.long) if filter_rows else None,
            max_top_k=max(top_k, default=-1),
            max_logprobs=max((n or 0 for n in num_logprobs), default=0),
            num_logprobs=num_logprobs,
            slot_list=[s.slot or 0 for s in seqs],
        )


@dataclass
class SamplerOutput:
    """One token per row; ``token_ids[i]`` is ``NO_TOKEN`` when the processors left row
    ``i`` no token at all (every logit ``-inf``: the request's constraints conflict) and
    ``INVALID_TOKEN`` when its final logits had no finite maximum otherwise (a NaN or
    ``+inf`` among them): that row drew nothing and its request must fail instead of
    emitting a token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row has a finite maximum (``amax`` propagates NaN)."""
    return torch.isfinite(logits.amax(dim=-1))


# Candidates examined before falling back to a full sort of the row: a nucleus is almost
# always far smaller, and topk over the vocabulary is much cheaper than sorting it.
_NUM_CANDIDATES = 1024


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 max_top_k: int) -> torch.Tensor:
    """Mask all but the top-k tokens and the smallest top-p nucleus, per row.

    The cut is a logit threshold found on the row's best candidates and applied in
    vocabulary order, so tokens tied with the last kept one stay in. When a row's nucleus
    is wider than the candidates (a very flat distribution), the whole batch is sorted.
    """
    vocab = logits.shape[1]
    keep = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    width = min(vocab, max(_NUM_CANDIDATES, max_top_k))
    if width < vocab:
        ordered = logits.topk(width, dim=-1).values
        probs = (ordered - logits.logsumexp(dim=-1, keepdim=True)).exp()
        cum = probs.cumsum(dim=-1)
        covered = (top_p >= 1.0) | (cum[:, -1] >= top_p)
        if not bool(covered.all()):
            width = vocab
    if width == vocab:
        ordered = logits.sort(dim=-1, descending=True).values
        probs = ordered.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
    in_nucleus = (cum - probs < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    keep = torch.minimum(keep.clamp(max=width), in_nucleus)
    threshold = ordered.gather(1, (keep - 1).unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


class Sampler:
    """Turns a step's float32 logits [B, V] into one token per row.

    Order (see ``freetoken_core.processors``): pre-temperature processors → greedy
    shortcut when every row is greedy → temperature → post-temperature processors → top-k
    and top-p (only on the rows that ask) → seeded inverse-CDF draw. Greedy rows inside a
    mixed batch take the argmax. Logprobs are those of the model's raw distribution
    (before processors and temperature), as vLLM reports by default. After the draw the
    processors fold the sampled tokens into their state.
    """

    def __init__(self, pipeline: ProcessorPipeline | None = None) -> None:
        self.pipeline = pipeline

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        pipeline = self.pipeline if self.pipeline is not None and self.pipeline.active() else None
        raw = logits.clone() if wants_logprobs and pipeline is not None else logits
        if pipeline is not None:
            # Host-side work (a grammar's mask) while an asynchronous device still computes
            # the logits.
            pipeline.prepare_step(batch.slot_list)
            pipeline.apply(logits, batch.slots, post_temperature=False,
                           all_greedy=batch.all_greedy)
        if batch.all_greedy and self._native_draw(logits):
            # The kernel's argmax (temperature 0: max, then its first index, rows in
            # parallel): torch's argmax took 0.9 ms of a 28 ms step of 16 rows on the Xeon.
            tokens, finite = self._native_sample(logits, batch)
        elif batch.all_greedy:
            tokens = logits.argmax(dim=-1)
            finite = _finite_rows(logits)
        else:
            tokens, finite = self._sample(logits, batch, pipeline)
        if pipeline is not None:
            pipeline.update(batch.slots, tokens)
        if bool(finite.all()):
            token_list = tokens.tolist()
        else:
            # ``logits`` went through the masking stages (all before temperature): a row
            # they set all to -inf has no token to draw.
            masked = torch.isneginf(logits).all(dim=-1)
            token_list = torch.where(finite, tokens, torch.where(
                masked, NO_TOKEN, INVALID_TOKEN)).tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if wants_logprobs:
            logprobs = self._logprobs(raw, tokens, batch)
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch,
                pipeline: ProcessorPipeline | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens and, per row, whether its final logits were finite."""
        between = batch.filter_rows is not None or (pipeline is not None
                                                    and pipeline.any_post_temperature())
        if not between and self._native_draw(logits):
            # Nothing between temperature and the draw: the kernel does both.
            return self._native_sample(logits, batch)
        greedy = batch.temperature == 0
        argmax = logits.argmax(dim=-1) if batch.any_greedy else None
        temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temp.unsqueeze(1)
        if pipeline is not None:
            pipeline.apply(logits, batch.slots, post_temperature=True, all_greedy=False)
        if batch.filter_rows is not None:
            rows = batch.filter_rows
            logits[rows] = _top_k_top_p(logits[rows], batch.top_k[rows], batch.top_p[rows],
                                        batch.max_top_k)
        if self._native_draw(logits):
            # Tempered and filtered already: the kernel draws at temperature 1 (0 for the
            # greedy rows, which take the argmax of what they had before temperature).
            tokens, finite = self._native_sample(logits, batch, tempered=True)
            return (tokens if argmax is None else torch.where(greedy, argmax, tokens)), finite
        finite = _finite_rows(logits)
        # Inverse CDF in vocabulary order: a row's draw depends on nothing but that row.
        cdf = logits.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        u = counter_uniform(batch.seeds, batch.counters).to(cdf.dtype).unsqueeze(1)
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        choice = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[1] - 1)
        choice = choice.squeeze(1)
        return (choice if argmax is None else torch.where(greedy, argmax, choice)), finite

    @staticmethod
    def _native_draw(logits: torch.Tensor) -> bool:
        """Whether the draw runs in the native CPU kernel: float32 logits on CPU, where the
        kernels could be built."""
        if not logits.is_cpu or logits.dtype != torch.float32:
            return False
        from freetoken_core.kernels import cpu_kernels_available

        return cpu_kernels_available()

    @staticmethod
    def _native_sample(logits: torch.Tensor, batch: SamplingBatch, tempered: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw of the torch path below in one native pass per row (sampler.cpp):
        softmax of logits / temperature, inverse CDF in vocabulary order with the row's
        counter-based uniform number; temperature 0 takes the argmax."""
        rows = logits.shape[0]
        temperature = batch.temperature
        if tempered:
            temperature = torch.where(temperature == 0, 0.0, 1.0).to(torch.float32)
        tokens = torch.empty(rows, dtype=torch.long)
        finite = torch.empty(rows, dtype=torch.bool)
        torch.ops.freetoken.sample_rows(logits.contiguous(), temperature.contiguous(),
                                        batch.seeds, batch.counters, tokens, finite)
        return tokens, finite

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
                  ) -> list[TokenLogprobs | None]:
        lp = raw.log_softmax(dim=-1)
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_v, top_i = lp.topk(batch.max_logprobs, dim=-1) if batch.max_logprobs else (None, None)
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        out: list[TokenLogprobs | None] = []
        for row, num in enumerate(batch.num_logprobs):
            if num is None:
                out.append(None)
                continue
            top = list(zip(top_i[row][:num], top_v[row][:num])) if num else []
            out.append(TokenLogprobs(int(tokens[row]), chosen[row], top))
        return out
