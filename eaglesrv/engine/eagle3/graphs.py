"""EAGLE-3's decode steps in graphs: the tree step, the plain step and the draft extend, per rung.

The tree step holds a step in which every request decodes and speculates with the
configured tree: the draft passes that grow the trees (engine/eagle3/drafting.py), the
tree masks, and the target's verification pass with its feature capture.

    in   root token, root log-probabilities and hidden state (the draft's output at the
         root), cached length, block-table row                           one row per request
    out  the trees (tokens, parents, depths, ranks), the target's logits at every node
         [B, N, vocab] float32 and its captured features [B, N, 3 * hidden]

The plain step is the target's decode step with feature capture (engine/graphs/
decode_step.py), for the steps in which no request speculates: adaptive speculation's
plain steps, and requests that cannot speculate (penalties).

Acceptance and compaction run on the host between the two graphs (they decide how many
tokens each request commits). The extend then feeds the draft what each request
committed, padded to a fixed `width` tokens per request (the most a step commits: the
configured tree's depth plus the bonus token, at most its nodes):

    in   committed tokens and their features [width], start position, index of the last
         real token, block-table row
    out  the draft's log-probabilities and hidden state at the last real token: the next
         root state

Padding tokens of a real request (past its last committed one) write the draft's K/V into
slots the scheduler reserved for the request's tree, which the next step's draft passes
overwrite before reading, and causal attention keeps them out of the real tokens' view.
Padding rows of a batch hold the pool's padding page in every column (both pools have it
at the same index) and a cached length of 0: every slot they write is on that page.

Steps with prefill chunks, trees smaller than the configured one (adaptive), a mix of
speculating and plain requests, batches above the top rung and page tables wider than the
graphs' run eagerly; the extend graph also serves the eager steps' extends whenever every
entry fits its width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.eagle3.drafting import grow_trees
from eaglesrv.engine.eagle3.tree import DraftTree
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.graphs.capture import CaptureMechanism
from eaglesrv.engine.graphs.decode_step import DecodeGraphs
from eaglesrv.engine.graphs.runner import GraphRunner, StaticInput
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.tree_shape import TreeShape
from eaglesrv.kernels.attention.base import AttentionBackend, padded_block_table, uniform_positions


class Eagle3Graphs:
    def __init__(
        self, target: LlamaForCausalLM, draft: Eagle3DraftModel, target_kv: KVPool, draft_kv: KVPool,
        attention: AttentionBackend, device: torch.device, shape: TreeShape, capture_layers: tuple[int, ...],
        max_batch_size: int, max_pages: int, mechanism: CaptureMechanism | None = None,
    ) -> None:
        """`shape`: the tree every graphed step verifies; `max_pages`: the widest page
        table a graph takes (a longer one runs eagerly)."""
        if not attention.graph_safe:
            raise ValueError(f"the {attention.name} attention backend cannot run in a graph")
        self.target, self.draft = target, draft
        self.target_kv, self.draft_kv = target_kv, draft_kv
        self.attention = attention
        self.device = device
        self.shape = shape
        self.capture_layers = capture_layers
        self.width = min(shape.steps + 1, shape.nodes)  # tokens a request commits in one step, at most
        self.max_positions = draft.config.arch.max_position_embeddings
        dtype = target_kv.k.dtype
        table = StaticInput((max_pages,), torch.int32, pad_value=target_kv.padding_page)
        tree_inputs = {
            "root_tokens": StaticInput((), torch.long),
            "root_logprobs": StaticInput((draft.config.draft_vocab_size,), torch.float32),
            "root_hidden": StaticInput((draft.config.arch.hidden_size,), dtype),
            "num_cached": StaticInput((), torch.int32),
            "block_table": table,
        }
        extend_inputs = {
            "tokens": StaticInput((self.width,), torch.long),
            "features": StaticInput((self.width, draft.fc.in_features), dtype),
            "num_cached": StaticInput((), torch.int32),
            "last": StaticInput((), torch.long),
            "block_table": table,
        }
        self.tree_runner = GraphRunner(self._tree_step, tree_inputs, max_batch_size, device, mechanism=mechanism)
        self.extend_runner = GraphRunner(self._extend_step, extend_inputs, max_batch_size, device,
                                         mechanism=self.tree_runner.mechanism, planner=attention.uniform_planner())
        self.plain = DecodeGraphs(target, target_kv, attention, device, max_batch_size, max_pages,
                                  self.tree_runner.mechanism, capture_layers)

    @property
    def batch_sizes(self) -> list[int]:
        return self.tree_runner.batch_sizes

    def capture(self) -> None:
        self.tree_runner.capture()
        self.extend_runner.capture()
        self.plain.capture()

    # ---- the tree step ---------------------------------------------------------------
    def holds(self, shape: TreeShape, batch_size: int) -> bool:
        """Whether a step in which all `batch_size` requests speculate with `shape` replays a graph."""
        return shape == self.shape and self.tree_runner.padded_batch_size(batch_size) is not None

    def tree_step(
        self, root_tokens: Sequence[int], root_logprobs: torch.Tensor, root_hidden: torch.Tensor,
        num_cached: Sequence[int], page_tables: Sequence[Sequence[int]],
    ) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
        """(trees, logits [B, N, vocab], features [B * N, 3 * hidden]) for B decoding requests.
        Views of the graph's static outputs: read them before the next tree step."""
        inputs = {
            "root_tokens": torch.tensor(root_tokens, dtype=torch.long),
            "root_logprobs": root_logprobs,
            "root_hidden": root_hidden,
            "num_cached": torch.tensor(num_cached, dtype=torch.int32),
            "block_table": padded_block_table(page_tables, self.target_kv.padding_page),
        }
        out = self.tree_runner.run({name: tensor.to(self.device) for name, tensor in inputs.items()})
        tree = DraftTree(out["tokens"], out["parents"], out["depths"], out["ranks"])
        return tree, out["logits"], out["features"].flatten(0, 1)

    def _tree_step(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        block_table, num_cached = inputs["block_table"], inputs["num_cached"]
        shape, k = self.shape, self.shape.topk

        def draft_context(f: int, masks: torch.Tensor) -> ForwardContext:
            metadata = self.attention.uniform_metadata(block_table, num_cached + (f - 1) * k, k, masks)
            return ForwardContext(self.attention, metadata, self.draft_kv)

        trees = grow_trees(self.draft, shape, inputs["root_tokens"], inputs["root_logprobs"], inputs["root_hidden"],
                           num_cached, draft_context)
        batch, nodes = trees.tokens.shape
        metadata = self.attention.uniform_metadata(block_table, num_cached, nodes, trees.ancestor_mask())
        positions = (num_cached.long()[:, None] + trees.depths).reshape(-1)
        hidden, features = self.target(trees.tokens.reshape(-1), positions,
                                       ForwardContext(self.attention, metadata, self.target_kv), self.capture_layers)
        return {
            "tokens": trees.tokens, "parents": trees.parents, "depths": trees.depths, "ranks": trees.ranks,
            "logits": self.target.compute_logits(hidden).view(batch, nodes, -1),
            "features": features.view(batch, nodes, -1),
        }

    # ---- the draft extend ------------------------------------------------------------
    def extend_holds(self, tokens: Sequence[Sequence[int]], starts: Sequence[int],
                     page_tables: Sequence[Sequence[int]]) -> bool:
        """Whether an extend of these entries replays a graph: each adds 1 to `width` tokens,
        and its padding tokens' positions stay on its own pages and in the rotary table."""
        if self.extend_runner.padded_batch_size(len(tokens)) is None:
            return False
        page_size = self.draft_kv.page_size
        return all(
            1 <= len(entry) <= self.width and start + self.width <= min(len(table) * page_size, self.max_positions)
            for entry, start, table in zip(tokens, starts, page_tables)
        )

    def extend(
        self, tokens: Sequence[Sequence[int]], features: torch.Tensor, starts: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [E, draft_vocab], hidden [E, H]) at each entry's last token.
        features [sum of lengths, 3 * hidden], packed like `tokens`. Fresh tensors."""
        counts = torch.tensor([len(entry) for entry in tokens])
        padded_tokens = torch.zeros(len(tokens), self.width, dtype=torch.long)
        padded_features = features.new_zeros(len(tokens), self.width, features.shape[-1])
        real = torch.arange(self.width)[None, :] < counts[:, None]  # host-side bool indexing, outside the graph
        padded_tokens[real] = torch.tensor([token for entry in tokens for token in entry], dtype=torch.long)
        padded_features[real.to(features.device)] = features
        inputs = {
            "tokens": padded_tokens,
            "features": padded_features,
            "num_cached": torch.tensor(starts, dtype=torch.int32),  # the runner moves them
            "last": counts - 1,
            "block_table": padded_block_table(page_tables, self.draft_kv.padding_page),
        }
        logprobs, hidden = self.extend_runner.run(inputs)
        return logprobs.clone(), hidden.clone()

    def _extend_step(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, num_cached = inputs["tokens"], inputs["num_cached"]
        batch, width = tokens.shape
        metadata = self.attention.uniform_metadata(inputs["block_table"], num_cached, width)
        positions = uniform_positions(num_cached, width).reshape(-1)
        last_rows = torch.arange(batch, device=tokens.device) * width + inputs["last"]
        logits, out = self.draft(tokens.reshape(-1), inputs["features"].flatten(0, 1), positions,
                                 ForwardContext(self.attention, metadata, self.draft_kv), logit_rows=last_rows)
        return torch.log_softmax(logits, dim=-1), out[last_rows]
