"""What the engine runs each step, behind one interface.

    Engine.step():  batch = scheduler.schedule()     (asks the runner's DecodeDemand)
                    results = runner.run(batch)
                    scheduler.update(batch, results)  -> finished ids -> runner.release()

A runner turns a ScheduledBatch into one SequenceResult per sampling sequence, and answers
what a decoding request needs from the next step (decode_lookahead, decode_cost: the
scheduler's DecodeDemand). Plain decoding (PlainRunner) is the trivial case: no lookahead,
one row per request, no state between steps. EAGLE-3 (eagle3/eagle3_runner.py) drafts and
verifies trees and keeps a record per request, which release() drops.

Offline passes that are not serving steps (scoring a prompt, capturing features for
training, timing passes for the cost model) go through forward_sequences / target_pass on
pages borrowed from the scheduler's allocator (PageAllocator.borrowed).
"""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.grammar_masks import GrammarMatchers
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.sampler import SamplingBatch
from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan
from eaglesrv.scheduler.batch import PromptLogprob, ScheduledBatch, SequenceWork, StepResults

SCORE_ROWS = 256  # prompt rows scored at once: never [prompt length, vocab] logits for a long chunk


class StepRunner(abc.ABC):
    mode: str = "abstract"  # what /get_server_info and the start-up log call it

    def __init__(self, target: LlamaForCausalLM, kv: KVPool, attention: AttentionBackend,
                 device: torch.device) -> None:
        self.target = target
        self.kv = kv
        self.attention = attention
        self.device = device
        # Structured output: the grammar state of each request that has one (None: the
        # engine has no tokenizer, so it takes no grammars). Set by the builder.
        self.grammars: GrammarMatchers | None = None

    # ---- what the scheduler asks (DecodeDemand) ---------------------------------------
    @property
    def decode_lookahead(self) -> int:
        """KV slots past its next token that a decoding request may use in a step."""
        return 0

    @property
    def decode_cost(self) -> int:
        """Rows of the per-step token budget a decoding request is likely to take next step."""
        return 1

    # ---- one step ---------------------------------------------------------------------
    @abc.abstractmethod
    def run(self, batch: ScheduledBatch) -> StepResults:
        """Forward the batch: one SequenceResult per sequence with sample=True, in order, and
        the prompt tokens scored (score_prompt_tokens)."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop what the runner keeps for these requests (they finished or were aborted)."""
        if self.grammars is not None:
            self.grammars.release(request_ids)

    def sampling_batch(self, seqs: Sequence[SequenceWork]) -> SamplingBatch:
        """The sampler's view of `seqs`, with the tokens each one's grammar allows now."""
        masks = self.grammars.allowed_now(seqs) if self.grammars is not None else {}
        return SamplingBatch.of(seqs, masks)

    def spec_stats(self) -> dict | None:
        """Speculation counters for /metrics and /get_server_info; None without speculation."""
        return None

    def after_warmup(self) -> None:
        """Forget what the warm-up taught: its dummy prompts say nothing about real traffic."""

    # ---- passes -----------------------------------------------------------------------
    def target_pass(
        self,
        token_ids: Sequence[int] | torch.Tensor,  # [num_tokens]
        positions: Sequence[int] | torch.Tensor,  # [num_tokens]
        spans: list[SequenceSpan],
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over packed tokens: hidden states [num_tokens, H] and, with
        capture_layers, the captured features [num_tokens, len(capture_layers) * H]."""
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.kv)
        return self.target(self._tensor(token_ids), self._tensor(positions), ctx, capture_layers)

    @torch.inference_mode()
    def forward_sequences(
        self, sequences: Sequence[Sequence[int]], page_tables: Sequence[list[int]], capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole sequences from position 0, packed in one pass, on the pages given (borrowed
        by the caller): hidden states [sum of lengths, H] and the captured features."""
        spans = [
            SequenceSpan(list(table), 0, len(tokens)) for table, tokens in zip(page_tables, sequences, strict=True)
        ]
        token_ids = [token for tokens in sequences for token in tokens]
        positions = [position for tokens in sequences for position in range(len(tokens))]
        return self.target_pass(token_ids, positions, spans, capture_layers)

    def score_prompt_tokens(self, seqs: Sequence[SequenceWork], offsets: Sequence[int],
                            hidden: torch.Tensor) -> dict[int, list[PromptLogprob]]:
        """The logprobs of the prompt tokens each sequence asks to score (SequenceWork.
        prompt_tokens_scored) from the target's hidden states [rows, H] of an eager pass in
        which sequence i's tokens start at row offsets[i]. Logits are computed for those
        rows only, SCORE_ROWS at a time; a sequence that asks nothing costs one check."""
        scored = {}
        for index, seq in enumerate(seqs):
            tokens = seq.prompt_tokens_scored()
            if not tokens:
                continue
            end = seq.num_cached + len(seq.token_ids)
            targets = [seq.token_ids[t - seq.num_cached] if t < end else seq.next_token_id for t in tokens]
            first_row = offsets[index] + tokens.start - 1 - seq.num_cached
            scored[index] = self._prompt_logprobs(hidden[first_row : first_row + len(tokens)], targets,
                                                  seq.params.prompt_logprobs)
        return scored

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[PromptLogprob]:
        scored = []
        target_ids = self._tensor(targets)
        for start in range(0, len(targets), SCORE_ROWS):
            logprobs = torch.log_softmax(self.target.compute_logits(hidden[start : start + SCORE_ROWS]).float(), -1)
            chosen = logprobs.gather(1, target_ids[start : start + SCORE_ROWS, None])
            ranks = (logprobs > chosen).sum(1, dtype=torch.int32) + 1  # int32: twice as fast as the default int64
            top_values, top_ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
            rows = zip(targets[start : start + SCORE_ROWS], chosen[:, 0].tolist(), ranks.tolist(),
                       top_ids.tolist(), top_values.tolist())
            scored += [PromptLogprob(t, lp, rank, list(zip(ids, values))) for t, lp, rank, ids, values in rows]
        return scored

    def _tensor(self, values: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(self.device)
        return torch.tensor(values, dtype=torch.long, device=self.device)
