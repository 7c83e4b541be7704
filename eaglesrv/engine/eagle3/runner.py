"""One engine step with EAGLE-3: draft trees, one target pass, acceptance, draft extend.

Per step, for the batch the scheduler chose:

  1. draft    requests that are decoding (and may speculate) grow a tree from their
              root state, num_steps - 1 draft passes over the draft's scratch slots
  2. target   one pass over everything: prefill chunks (causal), trees (tree mask),
              plain decodes; capturing the three feature layers for every token
  3. accept   greedy or tree rejection sampling per tree; plain sampling for the rest
  4. compact  the accepted nodes' K/V move next to the root, so the sequence stays
              contiguous in its pages (the scheduler then frees the pages past it)
  5. extend   one draft pass over the newly committed tokens, shifted by one:
              draft position i reads (token i + 1, target features at i). Its last
              output is the root state the next step drafts from.

Slots of a decoding request at root position n (pages reserved by the scheduler):

    target: n = root, n+1 .. n+N-1 = tree nodes in node order (verified, then compacted)
    draft:  n + (f-1)*topk + j = frontier node j of draft pass f (scratch, overwritten
            by step 5 of the same step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglesrv.configs import SpeculativeConfig
from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.eagle3.stats import SpecStats
from eaglesrv.engine.eagle3.tree import DraftTree, TreeBuilder, tree_size
from eaglesrv.engine.eagle3.verify import accept_greedy, accept_sampling
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.model_runner import sampling_batch
from eaglesrv.engine.sampler import compute_logprobs, processed_probs, request_uniforms, sample
from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan
from eaglesrv.scheduler.batch import ScheduledBatch, SequenceResult, SequenceWork


@dataclass
class RootState:
    """The draft's output at the last committed position, kept between steps."""

    position: int  # root position n: valid only while the request's num_cached == n
    hidden: torch.Tensor  # [H] pre-norm draft output, the features for the first draft pass
    logprobs: torch.Tensor  # [draft_vocab] draft log-probabilities of the root's children


class Eagle3Runner:
    def __init__(
        self,
        target: LlamaForCausalLM,
        draft: Eagle3DraftModel,
        target_kv: KVPool,
        draft_kv: KVPool,
        attention: AttentionBackend,
        device: torch.device,
        spec: SpeculativeConfig,
    ) -> None:
        self.target, self.draft = target, draft
        self.target_kv, self.draft_kv = target_kv, draft_kv
        self.attention = attention
        self.device = device
        self.spec = spec
        self.capture_layers = draft.config.capture_layers(target.arch.num_layers)
        self.num_nodes = tree_size(spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
        self.scratch_slots = (spec.num_steps - 1) * spec.eagle_topk
        self.roots: dict[str, RootState] = {}  # owned here; the engine calls forget() on finish
        self.stats = SpecStats(spec.num_steps)

    @property
    def lookahead(self) -> int:
        """Slots a decoding request needs past its root (tree nodes, draft scratch)."""
        return max(self.num_nodes, self.scratch_slots) - 1

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.roots.pop(request_id, None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SequenceResult]:
        seqs = batch.sequences
        speculating = [i for i, seq in enumerate(seqs) if self._may_speculate(seq)]
        trees = self._draft([seqs[i] for i in speculating]) if speculating else None
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
                mask = torch.cat([torch.ones(self.num_nodes, seq.num_cached, dtype=torch.bool), tree_masks[row]], 1)
                spans.append(SequenceSpan(seq.page_table, seq.num_cached, self.num_nodes, mask))
            else:
                token_ids.extend(seq.token_ids)
                positions.extend(range(seq.num_cached, seq.num_cached + len(seq.token_ids)))
                spans.append(SequenceSpan(seq.page_table, seq.num_cached, len(seq.token_ids)))
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.target_kv)
        hidden, features = self.target(self._tensor(token_ids), self._tensor(positions), ctx, self.capture_layers)

        # 3. accept / sample
        results: dict[int, SequenceResult] = {}
        kept_rows: dict[int, list[int]] = {}  # packed rows whose features the draft extend reads
        plain = [i for i, seq in enumerate(seqs) if seq.sample and i not in tree_row]
        if plain:
            last = [offsets[i] + len(seqs[i].token_ids) - 1 for i in plain]
            logits = self.target.compute_logits(hidden[self._tensor(last)])
            sampled = sample(logits, sampling_batch([seqs[i] for i in plain]))
            for i, token, logprobs in zip(plain, sampled.token_ids, sampled.logprobs):
                results[i] = SequenceResult.single(seqs[i], token, logprobs)
        if tree_row:
            self._verify(seqs, trees, tree_row, offsets, hidden, results, kept_rows)

        # 5. draft extend over what each sequence committed this step
        self._extend(seqs, results, offsets, kept_rows, features)
        return [results[i] for i in range(len(seqs)) if seqs[i].sample]

    # ---- 1. drafting ------------------------------------------------------------------
    def _may_speculate(self, seq: SequenceWork) -> bool:
        state = self.roots.get(seq.request_id)
        return (
            seq.sample
            and len(seq.token_ids) == 1
            and state is not None
            and state.position == seq.num_cached
            and not seq.params.uses_penalties  # penalties would change along a path
            and not seq.suppressed_token_ids  # so would min_tokens' suppression
            and seq.num_cached + self.lookahead + 1 <= min(seq.max_context_len, self.target.arch.max_position_embeddings)
        )

    def _draft(self, seqs: list[SequenceWork]) -> DraftTree:
        k = self.spec.eagle_topk
        states = [self.roots[seq.request_id] for seq in seqs]
        roots = [seq.num_cached for seq in seqs]
        builder = TreeBuilder(self._tensor([seq.token_ids[0] for seq in seqs]).cpu(), k, self.spec.num_draft_tokens)
        frontier = builder.expand_root(torch.stack([s.logprobs for s in states]).cpu())
        features = torch.stack([s.hidden for s in states]).unsqueeze(1).expand(-1, k, -1)  # [B, k, H]
        ancestry = torch.arange(k).expand(len(seqs), k).unsqueeze(-1)  # [B, k, depth] scratch slot per depth
        for depth in range(1, self.spec.num_steps):
            spans = [
                SequenceSpan(seq.page_table, n + (depth - 1) * k, k, _scratch_mask(n, ancestry[b], k))
                for b, (seq, n) in enumerate(zip(seqs, roots))
            ]
            ctx = ForwardContext(self.attention, self.attention.plan(spans), self.draft_kv)
            positions = torch.tensor(roots).repeat_interleave(k) + depth - 1
            input_ids = self.draft.draft_to_target[frontier.to(self.device)].reshape(-1)
            logits, out = self.draft(input_ids, features.reshape(-1, features.shape[-1]), positions.to(self.device), ctx)
            self.stats.draft_passes += 1
            logprobs = torch.log_softmax(logits, dim=-1).view(len(seqs), k, -1).cpu()
            frontier, parent_slot = builder.expand(logprobs)
            features = out.view(len(seqs), k, -1)[torch.arange(len(seqs))[:, None], parent_slot.to(self.device)]
            ancestry = torch.cat([ancestry.gather(1, parent_slot[..., None].expand(-1, -1, depth)),
                                  torch.arange(k).expand(len(seqs), k).unsqueeze(-1)], dim=-1)
        return builder.finish(self.draft.draft_to_target.cpu())

    # ---- 3. acceptance ---------------------------------------------------------------
    def _verify(self, seqs, trees: DraftTree, tree_row, offsets, hidden, results, kept_rows) -> None:
        """Accept a path through every tree; all node logits in one batched pass."""
        n = self.num_nodes
        order = list(tree_row)  # sequence indices, in tree-row order
        rows = [offsets[i] + node for i in order for node in range(n)]
        logits = self.target.compute_logits(hidden[self._tensor(rows)]).view(len(order), n, -1)
        argmax = logits.argmax(dim=-1).tolist()
        sampling = [b for b, i in enumerate(order) if not seqs[i].params.greedy]
        probs = {}
        if sampling:
            flat = logits[sampling].reshape(len(sampling) * n, -1)
            expanded = [seqs[order[b]] for b in sampling for _ in range(n)]
            probs = dict(zip(sampling, processed_probs(flat, sampling_batch(expanded)).view(len(sampling), n, -1).cpu()))
        node_tokens = trees.tokens.tolist()
        for b, i in enumerate(order):
            seq = seqs[i]
            children = trees.children(b)
            if b in probs:
                first = len(seq.output_token_ids)
                draws = self.spec.eagle_topk + 1
                acceptance = accept_sampling(node_tokens[b], children, probs[b],
                                             lambda d, s=seq.seed, f=first: request_uniforms(s, f + d, draws))
            else:
                acceptance = accept_greedy(node_tokens[b], children, argmax[b])
            self.stats.record(len(acceptance.path))
            tokens = acceptance.tokens(node_tokens[b])
            chooser = [0] + acceptance.path  # node whose logits chose each emitted token
            logprobs = compute_logprobs(logits[b][self._tensor(chooser)], tokens, [seq.params] * len(tokens))
            results[i] = SequenceResult(tokens, len(chooser), [lp for lp in logprobs if lp is not None], True)
            kept_rows[i] = [offsets[i] + node for node in chooser]
            self._compact(self.target_kv, seq, acceptance.path)

    # ---- 4. compaction ---------------------------------------------------------------
    def _compact(self, kv: KVPool, seq: SequenceWork, path: list[int]) -> None:
        moves = [(seq.num_cached + node, seq.num_cached + 1 + d) for d, node in enumerate(path) if node != d + 1]
        if not moves:
            return
        page = kv.page_size
        slot = lambda pos: seq.page_table[pos // page] * page + pos % page  # noqa: E731
        source = self._tensor([slot(src) for src, _ in moves])
        target = self._tensor([slot(dst) for _, dst in moves])
        kv.k[:, target] = kv.k[:, source]  # the gather copies first, so overlaps are safe
        kv.v[:, target] = kv.v[:, source]

    # ---- 5. draft extend -------------------------------------------------------------
    def _extend(self, seqs, results, offsets, kept_rows, features) -> None:
        token_ids, positions, rows, spans, finals = [], [], [], [], []
        for i, seq in enumerate(seqs):
            if i in kept_rows:
                committed = results[i].token_ids  # accepted tokens + bonus: x_{n+1} .. x_{n+m}
                seq_rows = kept_rows[i]
            else:
                following = results[i].token_ids[0] if seq.sample else seq.next_token_id
                committed = list(seq.token_ids[1:]) + [following]
                seq_rows = list(range(offsets[i], offsets[i] + len(seq.token_ids)))
            token_ids.extend(committed)
            positions.extend(range(seq.num_cached, seq.num_cached + len(committed)))
            rows.extend(seq_rows)
            spans.append(SequenceSpan(seq.page_table, seq.num_cached, len(committed)))
            finals.append((seq, len(token_ids) - 1, seq.num_cached + len(committed)))
        ctx = ForwardContext(self.attention, self.attention.plan(spans), self.draft_kv)
        logits, out = self.draft(self._tensor(token_ids), features[self._tensor(rows)], self._tensor(positions), ctx)
        last = self._tensor([row for seq, row, _ in finals if seq.sample])
        if len(last):
            logprobs = torch.log_softmax(logits[last], dim=-1)
            for (seq, row, position), lp, h in zip([f for f in finals if f[0].sample], logprobs, out[last]):
                self.roots[seq.request_id] = RootState(position, h, lp)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _scratch_mask(root: int, ancestry: torch.Tensor, k: int) -> torch.Tensor:
    """[k, root + depth*k] for one request's frontier: the committed prefix, plus the
    scratch slot of every ancestor (and itself) at each depth. ancestry: [k, depth]."""
    depth = ancestry.shape[1]
    scratch = torch.zeros(k, depth * k, dtype=torch.bool)
    columns = ancestry + torch.arange(depth) * k
    scratch[torch.arange(k)[:, None], columns] = True
    return torch.cat([torch.ones(k, root, dtype=torch.bool), scratch], dim=1)
