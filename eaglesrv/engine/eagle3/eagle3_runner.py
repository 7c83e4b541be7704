"""One engine step with EAGLE-3: draft trees, one target pass, acceptance, draft extend.

Per step, for the batch the scheduler chose:

  1. draft    requests that are decoding (and may speculate) grow a tree from their
              root state, num_steps - 1 draft passes over the draft's scratch slots
  2. target   one pass over everything: prefill chunks (causal), trees (tree mask),
              plain decodes; capturing the three feature layers for every token
  3. accept   greedy or tree rejection sampling per tree; plain sampling for the rest
  4. compact  the accepted nodes' K/V move next to the root, so the sequence stays
              contiguous in its pages (the scheduler then frees the pages past it);
              greedy acceptance and compaction are batched device ops (kernels/eagle3/)
  5. extend   one draft pass over the newly committed tokens, shifted by one:
              draft position i reads (token i + 1, target features at i). Its last
              output is the root state the next step drafts from.

Prefix caching: every step reports how far each request's draft KV reaches
(StepResults.reusable_tokens), and only pages whose draft KV is written enter the cache.
A request that hits the cache starts with the draft KV of the cached positions; the key of
a cached page includes the token after it, which the draft's last position there read.

Slots of a decoding request at root position n (pages reserved by the scheduler):

    target: n = root, n+1 .. n+N-1 = tree nodes in node order (verified, then compacted)
    draft:  n + (f-1)*topk + j = frontier node j of draft pass f (scratch, overwritten
            by step 5 of the same step)

Adaptive (`adaptive` given, the default): each step's shape and the requests that use it
come from the policy (adaptive/policy.py). Static (--disable-speculative-adaptive): every
step uses the configured tree for every request that may speculate. A request that decodes
without speculating skips steps 1 and 5: its features wait in the backlog, and one draft
extend over them (step 0, catch-up) precedes its next tree, so the draft sees every token
exactly as in the static mode. Prefill chunks feed the draft at once: their pages may be
shared through the prefix cache, which needs their draft KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from eaglesrv.configs import SpeculativeConfig
from eaglesrv.engine.adaptive.backlog import Backlog, HeldStep
from eaglesrv.engine.adaptive.controller import AdaptiveSpeculation
from eaglesrv.engine.adaptive.policy import StepLoad
from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.eagle3.drafting import grow_trees
from eaglesrv.engine.eagle3.graphs import Eagle3Graphs
from eaglesrv.engine.eagle3.request_state import RootState, SpecRequestState
from eaglesrv.engine.eagle3.stats import SpecStats
from eaglesrv.engine.eagle3.tree import DraftTree
from eaglesrv.engine.eagle3.verify import Acceptance, accept_sampling
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.graphs.decode_step import DecodeGraphs
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.sampler import SamplingBatch, compute_logprobs, processed_probs, request_uniforms, sample
from eaglesrv.engine.step_runner import StepRunner
from eaglesrv.engine.tree_shape import TreeShape
from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan, padded_block_table
from eaglesrv.kernels.eagle3 import compact_kv, greedy_accept
from eaglesrv.scheduler.batch import ScheduledBatch, SequenceResult, SequenceWork, StepResults


class Eagle3Runner(StepRunner):
    def __init__(
        self,
        target: LlamaForCausalLM,
        draft: Eagle3DraftModel,
        target_kv: KVPool,
        draft_kv: KVPool,
        attention: AttentionBackend,
        device: torch.device,
        spec: SpeculativeConfig,
        adaptive: AdaptiveSpeculation | None = None,
        graphs: Eagle3Graphs | None = None,
    ) -> None:
        super().__init__(target, target_kv, attention, device)
        self.draft, self.draft_kv = draft, draft_kv
        self.spec = spec
        self.capture_layers = draft.config.capture_layers(target.arch.num_layers)
        self.largest = TreeShape.from_config(spec)  # the configured tree: the most any step verifies
        self.num_nodes = self.largest.nodes
        self.scratch_slots = (spec.num_steps - 1) * spec.eagle_topk
        self.requests: dict[str, SpecRequestState] = {}  # one record per request, dropped in release()
        self.stats = SpecStats(spec.num_steps)
        self.adaptive = adaptive  # None: every step uses the configured tree (static)
        self.graphs = graphs  # the configured tree's decode steps and the draft extend, captured (CUDA)
        # Acceptance and compaction through the Triton kernels beside Triton attention (a
        # GPU, or the tests' interpreter); their torch references otherwise.
        self.step_kernels = attention.name == "triton"

    @property
    def mode(self) -> str:
        return "adaptive" if self.adaptive is not None else "static"

    @property
    def target_kv(self) -> KVPool:
        return self.kv

    # ---- what the scheduler asks --------------------------------------------------------
    @property
    def decode_lookahead(self) -> int:
        """Slots a decoding request needs past its root (tree nodes, draft scratch)."""
        return max(self.num_nodes, self.scratch_slots) - 1

    @property
    def decode_cost(self) -> int:
        """Rows a decoding request is likely to take next step (the scheduler's token budget)."""
        if self.adaptive is None:
            return self.num_nodes
        last = self.adaptive.last
        return last.shape.nodes if last is not None and last.shape is not None else 1

    def release(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        super().release(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def spec_stats(self) -> dict:
        snapshot = {**self.stats.snapshot(), "spec_adaptive": self.adaptive is not None}
        if self.adaptive is not None:
            snapshot.update(self.adaptive.snapshot())
        return snapshot

    def after_warmup(self) -> None:
        self.stats = SpecStats(self.spec.num_steps)  # count real traffic only
        if self.adaptive is not None:
            self.adaptive = self.adaptive.restart()

    def draft_pass(
        self,
        token_ids: torch.Tensor,  # [num_tokens]
        features: torch.Tensor,  # [num_tokens, 3 * target hidden] or [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        spans: list[SequenceSpan],
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over the draft's KV: (logits, pre-norm output), as Eagle3DraftModel."""
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.draft_kv)
        return self.draft(self._tensor(token_ids), features, self._tensor(positions), ctx, logit_rows=logit_rows)

    def _record(self, request_id: str) -> SpecRequestState:
        record = self.requests.get(request_id)
        if record is None:
            record = self.requests[request_id] = SpecRequestState()
        return record

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResults:
        seqs = batch.sequences
        for seq in seqs:
            if seq.admitted:  # its draft KV before num_cached came with a prefix-cache hit, if any
                self._record(seq.request_id).draft_end = seq.num_cached
        eligible = [i for i, seq in enumerate(seqs) if self._may_speculate(seq)]
        decision = None
        if self.adaptive is None:
            shape, speculating = self.largest, eligible
        else:
            # Timed costs feed the decision: rank 0 makes it for every tensor-parallel rank.
            decision = self.target.tp.leader_value(lambda: self._decide(seqs, eligible))
            shape, speculating = decision.shape, sorted(eligible[k] for k in decision.speculating)
        if speculating and self.adaptive is not None:
            self._catch_up([seqs[i] for i in speculating])  # 0. draft up to date first (timed apart)
        started = time.perf_counter()
        results: dict[int, SequenceResult] = {}
        scored: dict[int, list] = {}  # prompt tokens scored, by sequence (eager steps only: graphs hold no prompts)
        kept_rows: dict[int, list[int]] = {}  # rows of `features` the draft extend reads
        if len(speculating) == len(seqs) and self.graphs is not None and self.graphs.holds(shape, len(seqs)):
            features, offsets = self._graphed_tree_step(shape, seqs, results, kept_rows)
        elif not speculating and self.graphs is not None and DecodeGraphs.holds(seqs):
            features, offsets = self._graphed_plain_step(seqs, results)
        else:
            features, offsets = self._eager_step(shape, seqs, speculating, results, kept_rows, scored)

        # 5. draft extend over what each sequence committed this step
        self._extend(seqs, results, offsets, kept_rows, features)
        if decision is not None and all(len(seq.token_ids) == 1 for seq in seqs):  # decode-only steps calibrate
            self.adaptive.observe(decision, time.perf_counter() - started)
        return StepResults([results[i] for i in range(len(seqs)) if seqs[i].sample], scored,
                           {i: self._record(seq.request_id).draft_end for i, seq in enumerate(seqs)})

    def _eager_step(self, shape, seqs, speculating, results, kept_rows, scored) -> tuple[torch.Tensor, list[int]]:
        """Steps 1 to 4 without graphs, for any mix of trees, decodes and prefill chunks:
        (the target's features [rows, 3 * hidden], each sequence's first row in them)."""
        trees = self._draft(shape, [seqs[i] for i in speculating]) if speculating else None
        tree_row = {seq_index: row for row, seq_index in enumerate(speculating)}

        # 2. one target pass over every sequence
        token_ids, positions, spans, offsets = [], [], [], []
        tree_masks = trees.ancestor_mask() if trees is not None else None
        for i, seq in enumerate(seqs):
            offsets.append(len(token_ids))
            if i in tree_row:
                row = tree_row[i]
                token_ids.extend(trees.tokens[row].tolist())
                positions.extend((seq.num_cached + trees.depths[row]).tolist())
                spans.append(SequenceSpan(seq.page_table, seq.num_cached, trees.num_nodes, tree_masks[row]))
            else:
                token_ids.extend(seq.token_ids)
                positions.extend(range(seq.num_cached, seq.num_cached + len(seq.token_ids)))
                spans.append(SequenceSpan(seq.page_table, seq.num_cached, len(seq.token_ids)))
        hidden, features = self.target_pass(token_ids, positions, spans, self.capture_layers)
        # (a speculating sequence decodes: its rows are a tree's, and it has no prompt token left to score)
        scored.update(self.score_prompt_tokens(seqs, offsets, hidden))

        # 3. accept / sample
        plain = [i for i, seq in enumerate(seqs) if seq.sample and i not in tree_row]
        if plain:
            last = [offsets[i] + len(seqs[i].token_ids) - 1 for i in plain]
            logits = self.target.compute_logits(hidden[self._tensor(last)])
            sampled = sample(logits, self.sampling_batch([seqs[i] for i in plain]))
            for i, token, logprobs in zip(plain, sampled.token_ids, sampled.logprobs):
                results[i] = SequenceResult.single(seqs[i], token, logprobs)
        if tree_row:
            n = trees.num_nodes
            rows = (self._tensor([offsets[i] for i in tree_row])[:, None] + torch.arange(n, device=self.device))
            logits = self.target.compute_logits(hidden[rows.reshape(-1)]).view(len(tree_row), n, -1)
            self._verify(shape, seqs, trees, tree_row, offsets, logits, results, kept_rows)
        return features, offsets

    def _graphed_plain_step(self, seqs, results) -> tuple[torch.Tensor, list[int]]:
        """Steps 2 and 3 for a decode-only batch in which no request speculates."""
        logits, features = self.graphs.plain.logits_and_features(seqs)
        sampled = sample(logits, self.sampling_batch(seqs))
        for i, (token, logprobs) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
            results[i] = SequenceResult.single(seqs[i], token, logprobs)
        return features, list(range(len(seqs)))

    def _graphed_tree_step(self, shape, seqs, results, kept_rows) -> tuple[torch.Tensor, list[int]]:
        """Steps 1 to 4 for a batch in which every request speculates with the graphs' tree:
        drafting and verification replay one graph, acceptance and compaction follow."""
        logprobs, hidden = self._root_states(seqs)
        trees, logits, features = self.graphs.tree_step([seq.token_ids[0] for seq in seqs], logprobs, hidden,
                                                        [seq.num_cached for seq in seqs],
                                                        [seq.page_table for seq in seqs])
        self.stats.draft_passes += shape.steps - 1
        offsets = [i * trees.num_nodes for i in range(len(seqs))]
        self._verify(shape, seqs, trees, {i: i for i in range(len(seqs))}, offsets, logits, results, kept_rows)
        return features, offsets

    def _decide(self, seqs: list[SequenceWork], eligible: list[int]):
        decoding = sum(1 for seq in seqs if seq.sample and len(seq.token_ids) == 1)
        other_rows = sum(len(seq.token_ids) for seq in seqs) - decoding
        records = [self._record(seqs[i].request_id) for i in eligible]
        acceptance = [record.acceptance for record in records]
        repeated = self.adaptive.repeat_plain(decoding, other_rows, acceptance)
        if repeated is not None:
            return repeated
        may_speculate = set(eligible)
        load = StepLoad(
            decoding, [a.multiplier for a in acceptance], other_rows,
            backlogs=[len(r.backlog.tokens) if r.backlog is not None else 0 for r in records],
            remaining=[_remaining_tokens(seqs[i]) for i in eligible],
            contexts=[seqs[i].num_cached for i in eligible],
            other_context=sum(seq.num_cached for i, seq in enumerate(seqs)
                              if seq.sample and len(seq.token_ids) == 1 and i not in may_speculate),
        )
        return self.adaptive.decide(load, acceptance)

    # ---- 1. drafting ------------------------------------------------------------------
    def _may_speculate(self, seq: SequenceWork) -> bool:
        record = self.requests.get(seq.request_id)
        return (
            seq.sample
            and len(seq.token_ids) == 1
            and record is not None and record.draft_is_current(seq.num_cached)
            and not seq.params.uses_penalties  # penalties and logit_bias: see SamplingParams.uses_penalties
            and not seq.suppressed_token_ids  # so would min_tokens' suppression
            and seq.lookahead >= self.decode_lookahead  # the scheduler found slots for the largest tree
        )

    def _catch_up(self, seqs: list[SequenceWork]) -> None:
        """One draft extend over the backlog of every request about to draft after a spell
        without speculation: afterwards its root state sits at its root."""
        entries = []
        for seq in seqs:
            record = self.requests[seq.request_id]
            if record.backlog is not None:
                entries.append(self._drain(seq, record, keeps_root=True))
        if entries:
            started = time.perf_counter()
            self._draft_extend(entries)
            self.adaptive.costs.observe_catch_up(sum(len(e.tokens) for e in entries), time.perf_counter() - started)

    def _drain(self, seq: SequenceWork, record: SpecRequestState, keeps_root: bool) -> "_ExtendEntry":
        """The request's backlog as one draft-extend entry; the record holds none after."""
        held, record.backlog = record.backlog, None
        features = self.adaptive.features.read(held, seq.page_table)
        return _ExtendEntry(seq, held.start, held.tokens, features, keeps_root)

    def _draft(self, shape: TreeShape, seqs: list[SequenceWork]) -> DraftTree:
        k = shape.topk

        def context(f: int, masks: torch.Tensor) -> ForwardContext:
            spans = [SequenceSpan(seq.page_table, seq.num_cached + (f - 1) * k, k, mask)
                     for seq, mask in zip(seqs, masks)]
            return ForwardContext(self.attention, self.attention.plan(spans), self.draft_kv)

        self.stats.draft_passes += shape.steps - 1
        return grow_trees(self.draft, shape, self._tensor([seq.token_ids[0] for seq in seqs]),
                          *self._root_states(seqs), self._tensor([seq.num_cached for seq in seqs]), context,
                          self._grammar_constraint(seqs))

    def _grammar_constraint(self, seqs: list[SequenceWork]):
        """The draft's proposals masked by each request's grammar along the node's path (None
        without grammars). Acceptance does not depend on it (verification masks the target),
        but a draft that proposes forbidden tokens wastes its tree on them."""
        rows = [b for b, seq in enumerate(seqs) if seq.params.grammar]
        if not rows or self.grammars is None:
            return None
        to_target = self.draft.draft_to_target.cpu()

        def constrain(logprobs: torch.Tensor, paths: list[list[list[int]]]) -> torch.Tensor:
            constrained = logprobs.clone()
            for b in rows:
                allowed = self.grammars.path_masks(seqs[b], paths[b])[:, to_target].to(logprobs.device)
                masked = torch.log_softmax(logprobs[b].masked_fill(~allowed, float("-inf")), dim=-1)
                # a node after which the draft's vocabulary has nothing allowed keeps its own guesses
                constrained[b] = torch.where(allowed.any(-1, keepdim=True), masked, logprobs[b])
            return constrained

        return constrain

    def _root_states(self, seqs: list[SequenceWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's log-probabilities [B, draft_vocab] and hidden states [B, H] at the roots."""
        states = [self.requests[seq.request_id].root for seq in seqs]
        return torch.stack([s.logprobs for s in states]), torch.stack([s.hidden for s in states])

    # ---- 3. acceptance ---------------------------------------------------------------
    def _verify(self, shape, seqs, trees: DraftTree, tree_row, offsets, logits, results, kept_rows) -> None:
        """Accept a path through every tree, given the target's logits at every node
        [trees, nodes, vocab]; offsets[i] + node is the node's row of the step's features.
        Greedy trees are walked on the device in one batched op, sampled ones on the host."""
        n = trees.num_nodes
        order = list(tree_row)  # sequence indices, in tree-row order
        constrained = self._grammar_masked(trees, [seqs[i] for i in order], logits)  # logprobs stay raw
        acceptances = self._accept_greedy_trees(shape, trees, constrained, [seqs[i].params.greedy for i in order])
        sampling = [b for b, i in enumerate(order) if not seqs[i].params.greedy]
        probs = {}
        if sampling:
            flat = constrained[sampling].reshape(len(sampling) * n, -1)
            expanded = [seqs[order[b]] for b in sampling for _ in range(n)]
            probs = dict(zip(
                sampling, processed_probs(flat, SamplingBatch.of(expanded)).view(len(sampling), n, -1).cpu()))
        node_tokens = trees.tokens.tolist()
        for b, i in enumerate(order):
            seq = seqs[i]
            children = trees.children(b) if b in probs or self.adaptive is not None else None
            if b in probs:
                first = len(seq.output_token_ids)
                draws = shape.topk + 1
                acceptances[b] = accept_sampling(node_tokens[b], children, probs[b],
                                                 lambda d, s=seq.seed, f=first: request_uniforms(s, f + d, draws))
            acceptance = acceptances[b]
            self.stats.record(len(acceptance.path))
            if self.adaptive is not None:
                self.adaptive.acceptance.record(shape, trees.trials(b, children, acceptance.path),
                                                self.requests[seq.request_id].acceptance)
            tokens = acceptance.tokens(node_tokens[b])
            chooser = [0] + acceptance.path  # node whose logits chose each emitted token
            logprobs = compute_logprobs(logits[b][self._tensor(chooser)], tokens, [seq.params] * len(tokens))
            results[i] = SequenceResult(tokens, len(chooser), [lp for lp in logprobs if lp is not None], True)
            kept_rows[i] = [offsets[i] + node for node in chooser]
        self._compact([seqs[i] for i in order], [acceptances[b] for b in range(len(order))], shape.steps)

    def _grammar_masked(self, trees: DraftTree, seqs: list[SequenceWork], logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [trees, nodes, vocab] with -inf wherever a tree's grammar
        forbids the token after the node's path (a copy only when some tree has a grammar):
        acceptance then walks the masked distribution, exactly what plain decoding samples."""
        rows = [b for b, seq in enumerate(seqs) if seq.params.grammar]
        if not rows or self.grammars is None:
            return logits
        masked = logits.clone()
        tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
        for b in rows:
            allowed = self.grammars.tree_masks(seqs[b], tokens[b], parents[b]).to(logits.device)
            masked[b].masked_fill_(~allowed, float("-inf"))
        return masked

    def _accept_greedy_trees(self, shape, trees: DraftTree, logits, greedy: list[bool]) -> dict[int, Acceptance]:
        """Tree row -> acceptance for the greedy rows (kernels/eagle3/acceptance.py), read
        back to the host once."""
        rows = [b for b, is_greedy in enumerate(greedy) if is_greedy]
        if not rows:
            return {}
        index = self._tensor(rows)
        accepted, lengths, bonus = greedy_accept(trees.tokens[index], trees.parents[index],
                                                 logits[index].argmax(dim=-1), shape.steps, self.step_kernels)
        return {b: Acceptance(nodes[1:length], token)
                for b, nodes, length, token in zip(rows, accepted.tolist(), lengths.tolist(), bonus.tolist())}

    # ---- 4. compaction ---------------------------------------------------------------
    def _compact(self, seqs: list[SequenceWork], acceptances: list[Acceptance], depth: int) -> None:
        """Move every tree's accepted nodes' K/V next to its root, in one op (kernels/eagle3/compaction.py)."""
        accepted = torch.full((len(seqs), depth + 1), -1, dtype=torch.long)
        for row, acceptance in enumerate(acceptances):
            accepted[row, : len(acceptance.path) + 1] = torch.tensor([0] + acceptance.path)
        lengths = torch.tensor([len(acceptance.path) + 1 for acceptance in acceptances])
        table = padded_block_table([seq.page_table for seq in seqs])
        roots = torch.tensor([seq.num_cached for seq in seqs], dtype=torch.int32)
        compact_kv(self.target_kv.k, self.target_kv.v, accepted.to(self.device), lengths.to(self.device),
                   table.to(self.device), roots.to(self.device), self.target_kv.page_size, self.step_kernels)

    # ---- 5. draft extend -------------------------------------------------------------
    def _extend(self, seqs, results, offsets, kept_rows, features) -> None:
        """Feed the draft what each sequence committed this step (or, adaptive, hold it in
        the backlog for sequences that did not speculate)."""
        entries, held = [], []
        for i, seq in enumerate(seqs):
            if i in kept_rows:
                committed = results[i].token_ids  # accepted tokens + bonus: x_{n+1} .. x_{n+m}
                rows = kept_rows[i]
            else:
                following = results[i].token_ids[0] if seq.sample else seq.next_token_id
                committed = list(seq.token_ids[1:]) + [following]
                rows = list(range(offsets[i], offsets[i] + len(seq.token_ids)))
            if self.adaptive is not None and i not in kept_rows and seq.sample and len(seq.token_ids) == 1:
                held.append((seq, committed, rows))  # a plain decode: the draft catches up when it speculates
            else:
                if self.adaptive is not None and i not in kept_rows:
                    # A prefill chunk. Any backlog is stale: chunks come before the first
                    # decode, or after a preemption, which restarts the request earlier.
                    self._record(seq.request_id).backlog = None
                entries.append(_ExtendEntry(seq, seq.num_cached, committed, rows, keeps_root=seq.sample))
        if held:
            entries += self._hold(held, features)
        if entries:
            self._draft_extend(entries, features)

    def _hold(self, held, features) -> list["_ExtendEntry"]:
        """Put non-speculating sequences' features in the pool and their positions in their
        backlogs; returns extends for backlogs that grew past the limit (drained now, to
        keep catch-ups bounded)."""
        pool = self.adaptive.features
        steps = [HeldStep(seq.page_table, seq.num_cached, committed) for seq, committed, _ in held]
        pool.write(steps, features[self._tensor([row for _, _, rows in held for row in rows])])
        drained = []
        for (seq, _, _), step in zip(held, steps):
            record = self._record(seq.request_id)
            record.backlog = Backlog.grow(record.backlog, step)
            if pool.over_limit(record.backlog):
                drained.append(self._drain(seq, record, keeps_root=seq.sample))
        return drained

    def _draft_extend(self, entries: list["_ExtendEntry"], step_features: torch.Tensor | None = None) -> None:
        """One draft pass over every entry's tokens (through the extend graph when they fit
        it); entries that keep a root store the draft's output at their last token. Entry
        features are row indices into `step_features`, or tensors of their own (backlog)."""
        if all(isinstance(entry.features, list) for entry in entries):  # one gather for the whole step
            features = step_features[self._tensor([row for entry in entries for row in entry.features])]
        else:
            features = torch.cat([step_features[self._tensor(entry.features)] if isinstance(entry.features, list)
                                  else entry.features for entry in entries])
        tables = [entry.seq.page_table for entry in entries]
        starts = [entry.start for entry in entries]
        tokens = [entry.tokens for entry in entries]
        if self.graphs is not None and self.graphs.extend_holds(tokens, starts, tables):
            logprobs, hidden = self.graphs.extend(tokens, features, starts, tables)
        else:
            logprobs, hidden = self._eager_extend(tokens, features, starts, tables)
        for entry, lp, h in zip(entries, logprobs, hidden):
            record = self._record(entry.seq.request_id)
            record.draft_written(entry.start, len(entry.tokens))
            if entry.keeps_root:
                record.root = RootState(entry.start + len(entry.tokens), h, lp)

    def _eager_extend(self, tokens, features, starts, tables) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, hidden) of the draft at every entry's last token."""
        spans = [SequenceSpan(table, start, len(entry)) for entry, start, table in zip(tokens, starts, tables)]
        positions = [start + i for entry, start in zip(tokens, starts) for i in range(len(entry))]
        last = self._tensor([len(entry) for entry in tokens]).cumsum(0) - 1
        logits, out = self.draft_pass([t for entry in tokens for t in entry], features, positions, spans,
                                      logit_rows=last)
        return torch.log_softmax(logits, dim=-1), out[last]


@dataclass
class _ExtendEntry:
    """Tokens one sequence feeds the draft: draft positions start .. start + len(tokens) - 1."""

    seq: SequenceWork
    start: int
    tokens: list[int]
    features: list[int] | torch.Tensor  # rows of this step's target features, or held features
    keeps_root: bool  # store the draft's output at the last token as the next root state


def _remaining_tokens(seq: SequenceWork) -> int:
    """Tokens the request may still generate (its context limit when max_tokens is unset)."""
    by_context = seq.max_context_len - seq.num_cached
    if seq.params.max_tokens is None:
        return by_context
    return min(by_context, seq.params.max_tokens - len(seq.output_token_ids))
