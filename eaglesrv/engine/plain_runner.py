"""Plain decoding: one forward over every sequence's new tokens, then sample the next token.

With decode graphs (CUDA, unless --disable-cuda-graph), a decode-only step replays a
captured graph of the target pass instead (engine/graphs/decode_step.py).
"""

from __future__ import annotations

import torch

from eaglesrv.engine.graphs.decode_step import DecodeGraphs
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.sampler import sample
from eaglesrv.engine.step_runner import StepRunner
from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan
from eaglesrv.scheduler.batch import ScheduledBatch, SequenceResult, StepResults


class PlainRunner(StepRunner):
    mode = "plain"

    def __init__(self, target: LlamaForCausalLM, kv: KVPool, attention: AttentionBackend, device: torch.device,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        super().__init__(target, kv, attention, device)
        self.decode_graphs = decode_graphs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResults:
        sequences = batch.sequences
        if self.decode_graphs is not None and DecodeGraphs.holds(sequences):  # no prompt rows to score
            return StepResults(self._sampled(sequences, self.decode_graphs.logits(sequences)))
        token_ids: list[int] = []
        positions: list[int] = []
        offsets: list[int] = []  # packed row of each sequence's first token
        last_rows: list[int] = []  # packed row of each sampling sequence's last token
        for seq in sequences:
            offsets.append(len(token_ids))
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_cached, seq.num_cached + len(seq.token_ids)))
            if seq.sample:
                last_rows.append(len(token_ids) - 1)
        spans = [SequenceSpan(seq.page_table, seq.num_cached, len(seq.token_ids)) for seq in sequences]
        hidden, _ = self.target_pass(token_ids, positions, spans)
        scored = self.score_prompt_tokens(sequences, offsets, hidden)
        if not last_rows:
            return StepResults([], scored)
        logits = self.target.compute_logits(hidden[self._tensor(last_rows)])
        return StepResults(self._sampled([seq for seq in sequences if seq.sample], logits), scored)

    def _sampled(self, samplers, logits: torch.Tensor) -> list[SequenceResult]:
        result = sample(logits, self.sampling_batch(samplers))
        return [
            SequenceResult.single(seq, token, logprobs)
            for seq, token, logprobs in zip(samplers, result.token_ids, result.logprobs)
        ]

