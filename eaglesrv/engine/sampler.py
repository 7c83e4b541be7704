"""Token sampler: pure torch functions over the rows of a batch that sample this step.

Pipeline per step (all vectorized over the batch, computed in float32):

    raw logits --apply_penalties--> penalized --temperature, top-k, top-p, min-p-->
    processed probs --inverse CDF with request_uniforms(seed, step)--> token

Greedy rows (temperature 0 or top_k 1) take argmax of the penalized logits. Tokens a
row's grammar forbids (SamplingBatch.token_masks) are -inf from the start, like suppressed
ones. Logprobs are log_softmax of the raw logits (vLLM's default), only for rows that ask.

The pieces are public because EAGLE-3 verification reuses them: it needs the processed
target distribution (`processed_probs`) and uniforms that depend only on (seed, step)
(`request_uniforms`), so a seeded request samples the same tokens whatever else is in
the batch, and after preemption, with no generator state to keep.

Filter conventions (row-local, so a row's result never depends on other rows):
  top_k  ranks by a stable descending sort; ties at the cut keep the lowest token id.
  top_p  keeps the smallest most-likely-first prefix whose mass reaches top_p: a token is
         kept iff the mass ranked strictly above it is < top_p - 1e-6 (the slack absorbs
         softmax rounding, so probs [.5, .3, .15, .05] with top_p .8 keep exactly two).
         Computed on the top-k-renormalized distribution.
  min_p  keeps tokens with prob >= min_p * max prob (ratio, so renormalizing is moot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from eaglesrv.scheduler.batch import SequenceWork

from eaglesrv.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TOP_P_SLACK = 1e-6
_MIN_TEMPERATURE = 1e-6
_CDF_BLOCK = 1024  # the largest block of the two-level inverse CDF
_FLOAT64_SUM_BYTES = 16 << 20  # the float64 copy a block sum makes, at most, per chunk of rows


@dataclass
class SamplingBatch:
    params: list[SamplingParams]  # one per row of logits
    output_token_ids: list[list[int]]  # tokens generated so far per request (penalties)
    seeds: list[int]  # resolved per-request seed (unseeded requests get one at admission)
    step_indices: list[int]  # index of the output token being sampled
    # per row, token ids that may not be sampled now (EOS and stop ids before min_tokens)
    suppressed_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    # per row, the request's prompt (repetition_penalty counts it); empty: no prompt tokens
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    # row -> bool [V]: the tokens a grammar allows (rows without a grammar are absent)
    token_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, seqs: Sequence[SequenceWork], token_masks: dict[int, torch.Tensor] | None = None) -> "SamplingBatch":
        """The sampler's view of sequences that sample this step, one row each."""
        return cls(
            token_masks=token_masks or {},
            params=[s.params for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            seeds=[s.seed for s in seqs],
            step_indices=[len(s.output_token_ids) for s in seqs],
            suppressed_token_ids=[s.suppressed_token_ids for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
        )


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n alternatives, most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


# ---------------------------------------------------------------------------- uniforms


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a cheap bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_uniforms(seed: int, step_index: int, n: int) -> torch.Tensor:
    """[n] float64 uniforms in [0, 1) that depend only on (seed, step_index).

    Drawn from a fresh CPU generator (CPU so values are identical on every device), and
    a prefix of a longer draw equals a shorter draw, so uniform 0 is the same whether a
    step is sampled plainly or verified speculatively.
    """
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ (step_index & _MASK64))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(key)  # accepts [0, 2**64)
    return torch.rand(n, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------- penalties


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits [B, V] after suppression and grammar masks and, in transformers'
    order, logit_bias, repetition_penalty (over prompt and output tokens), then OpenAI's
    presence and frequency penalties (over output tokens).

    Returns a new tensor when any of them applies (the input is never modified); rows
    without them are left bit-identical. Token ids past the logits' width are ignored.
    """
    logits = _mask_disallowed(_suppress(logits.float(), batch), batch)
    params = batch.params
    if any(p.logit_bias for p in params):
        logits = _add_logit_bias(logits, params)
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = _repetition_penalty(logits, batch)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        logits = _presence_frequency_penalties(logits, batch)
    return logits


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits + each row's bias at its token ids (ids are unique per row, so no accumulation)."""
    vocab = logits.shape[1]
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias if token < vocab]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.index_put(index, logits[index] + torch.tensor(biases, dtype=torch.float32, device=logits.device))


def _repetition_penalty(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """transformers' repetition penalty: for each distinct token of the prompt and the
    output, a negative logit times the penalty, any other divided by it."""
    rows = [i for i, p in enumerate(batch.params) if p.repetition_penalty != 1.0]
    vocab = logits.shape[1]
    histories = [torch.tensor(_prompt(batch, i) + batch.output_token_ids[i], dtype=torch.long) for i in rows]
    row_index = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(h) for h in histories]))
    # Column `vocab` absorbs ids past the logits' width, as transformers does; it is dropped.
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=logits.device)
    seen[row_index.to(logits.device), torch.cat(histories).clamp(max=vocab).to(logits.device)] = True
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits[index]
    penalty = _row_tensor([batch.params[i].repetition_penalty for i in rows], logits.device)
    penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
    return logits.index_copy(0, index, torch.where(seen[:, :vocab], penalized, sub))


def _prompt(batch: SamplingBatch, row: int) -> list[int]:
    return batch.prompt_token_ids[row] if batch.prompt_token_ids else []


def _presence_frequency_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI's penalties: logits -= presence * (count > 0) + frequency * count, over output
    tokens (0 - 0 leaves the other rows bit-identical)."""
    rows = [i for i, p in enumerate(batch.params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    num_rows, vocab = logits.shape
    flat_index: list[int] = []
    for i in rows:
        flat_index.extend(i * vocab + t for t in batch.output_token_ids[i] if t < vocab)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=logits.device)
    if flat_index:
        index = torch.tensor(flat_index, dtype=torch.long, device=logits.device)
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    counts = counts.view(num_rows, vocab)
    presence = _row_tensor([p.presence_penalty for p in batch.params], logits.device)
    frequency = _row_tensor([p.frequency_penalty for p in batch.params], logits.device)
    return logits - (presence * (counts > 0) + frequency * counts)


def _mask_disallowed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """-inf for every token a row's grammar forbids (a copy only when some row has a grammar)."""
    if not batch.token_masks:
        return logits
    rows = list(batch.token_masks)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = torch.stack([batch.token_masks[row] for row in rows]).to(logits.device)
    return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))


def _suppress(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """-inf for each row's suppressed tokens (a copy only when some row has any)."""
    pairs = [(row, t) for row, ids in enumerate(batch.suppressed_token_ids) for t in ids if t < logits.shape[1]]
    if not pairs:
        return logits
    logits = logits.clone()
    rows, tokens = zip(*pairs)
    logits[list(rows), list(tokens)] = float("-inf")
    return logits


# ---------------------------------------------------------------------------- probs


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 probs [B, V] that the sampler draws from: penalties, temperature, top-k,
    top-p, min-p, renormalized. Greedy rows are one-hot at argmax of the penalized logits."""
    return _probs_from_penalized(apply_penalties(logits, batch), batch)


def _probs_from_penalized(penalized: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    device = penalized.device
    params = batch.params
    # Greedy rows get temperature 1 only to keep the division finite (they are replaced
    # below); tiny temperatures are floored so logits / T cannot overflow to inf.
    temps = [1.0 if p.greedy else max(p.temperature, _MIN_TEMPERATURE) for p in params]
    scaled = penalized / _row_tensor(temps, device)
    keep = _filter_mask(scaled, params)
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.greedy for p in params):
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device)
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, penalized.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def _uses_filters(p: SamplingParams) -> bool:
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def _filter_mask(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Bool keep-mask [B, V] for top-k/top-p/min-p, or None when no row filters.

    Only the rows that filter are sorted (once, together); the others keep everything,
    so their softmax is exactly the unfiltered one.
    """
    rows = [i for i, p in enumerate(params) if _uses_filters(p)]
    if not rows:
        return None
    device = scaled.device
    vocab = scaled.shape[1]
    sub = [params[i] for i in rows]
    top_k = _row_tensor([p.top_k if p.top_k > 0 else vocab for p in sub], device)
    top_p = _row_tensor([p.top_p for p in sub], device)
    min_p = _row_tensor([p.min_p for p in sub], device)

    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    sorted_logits, order = torch.sort(scaled[row_index], dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device, dtype=torch.float32).unsqueeze(0)
    keep_sorted = rank < top_k  # [R, V]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)

    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # top_p == 1 rows skip the test: the slack must not trim their tail.
    in_top_p = (mass_above < top_p - _TOP_P_SLACK) | (top_p >= 1.0)
    keep_sorted &= in_top_p
    keep_sorted &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep_sorted[:, 0] = True  # the most likely token always survives

    keep = torch.ones_like(scaled, dtype=torch.bool)
    keep[row_index] = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return keep


# ---------------------------------------------------------------------------- drawing


def draw_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: long [B] token ids from probs [B, V] and uniforms [B] in [0, 1).

    Token i is drawn iff cdf[i-1] <= u < cdf[i], so zero-prob tokens are never drawn. The
    CDF is accumulated in float64 in two levels: the sums of blocks of tokens, then the
    running sum inside the one block u falls in. A whole [B, V] float64 CDF (two 25 MB
    buffers at 64 rows of 49,152 tokens) made the draw 2.3 times as slow on a 2-core CPU.
    A u at or past the CDF's end (rounding) falls back to the last token with nonzero
    probability.
    """
    rows, vocab = probs.shape
    width = _cdf_block_width(vocab)
    padded = probs if vocab % width == 0 else torch.nn.functional.pad(probs, (0, -vocab % width))
    blocks = padded.view(rows, -1, width)
    num_blocks = blocks.shape[1]
    # A float64 sum casts all of its input first; by chunks of rows that copy stays under
    # glibc's 32 MiB mmap ceiling (utils/malloc.py) instead of being faulted in each step.
    rows_per_sum = max(1, _FLOAT64_SUM_BYTES // (8 * padded.shape[1]))
    sums = torch.cat([chunk.sum(-1, dtype=torch.float64) for chunk in blocks.split(rows_per_sum)])  # [B, blocks]
    ends = sums.cumsum(-1)  # [B, blocks]: the CDF at each block's last token
    u = uniforms.to(device=probs.device, dtype=torch.float64).unsqueeze(1)
    block = torch.searchsorted(ends, u, right=True).squeeze(1)  # the first block ending past u
    past_end = block >= num_blocks
    last_block = num_blocks - 1 - _first_true((sums > 0).flip(-1))
    block = torch.where(past_end, last_block, block)
    chosen = blocks[torch.arange(rows, device=probs.device), block]  # [B, width]
    starts = torch.nn.functional.pad(ends, (1, 0)).gather(1, block.unsqueeze(1))  # the CDF before the block
    running = starts + chosen.double().cumsum(-1)  # the CDF inside the block
    offset = torch.searchsorted(running, u, right=True).squeeze(1)
    offset = torch.where(past_end | (offset >= width), width - 1 - _first_true((chosen > 0).flip(-1)), offset)
    return (block * width + offset).clamp(max=vocab - 1)


def _cdf_block_width(vocab: int) -> int:
    """Tokens per block of the two-level CDF: one block for a small vocabulary, else a
    power of two that divides it (no padded copy), else 1,024 with padding."""
    if vocab <= _CDF_BLOCK:
        return vocab
    divisor = math.gcd(vocab, _CDF_BLOCK)
    return divisor if divisor >= 64 else _CDF_BLOCK


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim (0 where there is none)."""
    return torch.argmax(mask.to(torch.uint8), dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of logits [B, V] (any float dtype) and its logprobs."""
    if logits.shape[0] != len(batch.params):
        raise ValueError(f"logits has {logits.shape[0]} rows but batch has {len(batch.params)}")
    if logits.shape[0] == 0:
        return SamplerOutput(token_ids=[], logprobs=[])
    penalized = apply_penalties(logits, batch)
    is_greedy = [p.greedy for p in batch.params]
    if all(is_greedy):
        ids = penalized.argmax(dim=-1).tolist()  # ties -> lowest id
    else:
        probs = _probs_from_penalized(penalized, batch)
        # A greedy row's probs are one-hot at its argmax, which any uniform draws.
        uniforms = torch.tensor(
            [
                0.0 if g else float(request_uniforms(s, k, 1)[0])
                for g, s, k in zip(is_greedy, batch.seeds, batch.step_indices)
            ],
            dtype=torch.float64,
        )
        ids = draw_from_probs(probs, uniforms).tolist()
    return SamplerOutput(token_ids=ids, logprobs=compute_logprobs(logits, ids, batch.params))


# ---------------------------------------------------------------------------- logprobs


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Chosen-token logprob and top-n alternatives from the raw logits [B, V], for the
    rows whose params.logprobs is not None (the others get None)."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    logp = torch.log_softmax(logits[row_index].float(), dim=-1)  # [R, V]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], dtype=torch.long, device=device)
    chosen = logp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    n_max = min(max(params[i].logprobs or 0 for i in rows), logp.shape[1])
    top_vals, top_ids = torch.topk(logp, n_max, dim=-1) if n_max else (None, None)
    for r, i in enumerate(rows):
        n = min(params[i].logprobs or 0, n_max)
        top: list[tuple[int, float]] = []
        if n:
            top = list(zip(top_ids[r, :n].tolist(), top_vals[r, :n].tolist()))
        out[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen[r], top=top)
    return out


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row parameter column [B, 1] in float32, to broadcast against [B, V]."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
