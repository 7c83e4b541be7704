"""Runs one scheduled batch through the model and samples the next tokens."""

from __future__ import annotations

import torch

from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.sampler import SamplingBatch, sample
from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan
from eaglesrv.scheduler.batch import ScheduledBatch, SequenceResult, SequenceWork


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVPool, attention: AttentionBackend, device: torch.device):
        self.model = model
        self.kv = kv
        self.attention = attention
        self.device = device

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], page_table: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence [len, vocab], float32 (scoring, tests).

        The caller lends `page_table` (enough pages for the sequence) and frees it after.
        """
        spans = [SequenceSpan(page_table, 0, len(token_ids))]
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.kv)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden, _ = self.model(torch.tensor(token_ids, device=self.device), positions, ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SequenceResult]:
        """Forward every sequence's new tokens; one SequenceResult per sequence with sample=True."""
        sequences = batch.sequences
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []  # packed row of each sampling sequence's last token
        for seq in sequences:
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_cached, seq.num_cached + len(seq.token_ids)))
            if seq.sample:
                last_rows.append(len(token_ids) - 1)
        spans = [SequenceSpan(seq.page_table, seq.num_cached, len(seq.token_ids)) for seq in sequences]
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.kv)
        hidden, _ = self.model(
            torch.tensor(token_ids, device=self.device), torch.tensor(positions, device=self.device), ctx
        )
        if not last_rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        samplers = [seq for seq in sequences if seq.sample]
        result = sample(logits, sampling_batch(samplers))
        return [
            SequenceResult.single(seq, token, logprobs)
            for seq, token, logprobs in zip(samplers, result.token_ids, result.logprobs)
        ]


def sampling_batch(seqs: list[SequenceWork]) -> SamplingBatch:
    """The sampler's view of the sequences that sample this step (one row each)."""
    return SamplingBatch(
        params=[s.params for s in seqs],
        output_token_ids=[s.output_token_ids for s in seqs],
        seeds=[s.seed for s in seqs],
        step_indices=[len(s.output_token_ids) for s in seqs],
        suppressed_token_ids=[s.suppressed_token_ids for s in seqs],
    )
