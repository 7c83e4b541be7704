"""The attention backend interface.

A forward pass covers a batch of sequences. Each sequence has `num_cached` tokens whose
K/V are already in the paged cache and adds `num_new` tokens. The new tokens' queries
are packed back to back across sequences ([num_tokens, heads, head_dim]); their K/V are
written into the cache at the slots their positions map to, then every query attends
over its sequence's keys [0, num_cached + num_new) under a mask:

    default (causal):  new token i sees keys j <= num_cached + i
    custom (tree):     mask[i, w] given for the last W keys, shape [num_new, W] with
                       num_new <= W <= num_cached + num_new; the keys before them are
                       all visible (a tree over a committed prefix)

A custom mask's size does not depend on the context length, so a graph can hold it: a
verified tree has W = num_new (the nodes), a draft pass W = its scratch slots.

Paged layout: the cache of one layer is [num_pages * page_size, kv_heads, head_dim];
token t of a sequence lives in slot page_table[t // page_size] * page_size + t % page_size.

    page_table = [7, 2]  page_size = 4
    tokens 0..3 -> slots 28..31 (page 7),  tokens 4..7 -> slots 8..11 (page 2)
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


@dataclass(frozen=True)
class SequenceSpan:
    """The attention view of one sequence in a forward pass."""

    page_table: list[int]
    num_cached: int
    num_new: int
    custom_mask: torch.Tensor | None = None  # [num_new, W] bool over the last W keys, True = may attend


class AttentionMetadata:
    """Per-pass tensors a backend precomputes once and reuses in every layer."""


class UniformPlanner(abc.ABC):
    """Host-side planning that a backend's graph passes need before every run of a graphed
    step (a backend whose kernels read their schedule from buffers filled on the host).

    A graph runner holds one per step and opens a session around each run of the step, the
    warm-up and capture included: `host` holds the host copies of the step's `input_names`
    exactly as the step sees them (padded to the graph's batch), `step_inputs` the tensors
    the step receives, `graphed` whether the run is a graph's (warm-up, capture, replay) or
    an eager one. Within a session the backend's `uniform_metadata`, called with those very
    block-table and cached-length tensors, may serve passes from the host copies."""

    input_names = ("block_table", "num_cached")

    @abc.abstractmethod
    def session(self, host: Mapping[str, torch.Tensor], step_inputs: Mapping[str, torch.Tensor],
                graphed: bool) -> AbstractContextManager[None]:
        """Plan for one run of the step (before a replay: every pass the graph holds)."""


class AttentionBackend(abc.ABC):
    name: str = "abstract"
    # Whether uniform_metadata is implemented: only such a backend can run in a graph.
    graph_safe: bool = False

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device

    @abc.abstractmethod
    def plan(self, spans: list[SequenceSpan]) -> AttentionMetadata:
        """Precompute slot mappings and masks for one forward pass."""

    def uniform_metadata(self, block_table: torch.Tensor, num_cached: torch.Tensor, num_new: int,
                         tree_mask: torch.Tensor | None = None) -> AttentionMetadata:
        """The metadata of a pass in which every sequence adds `num_new` tokens, built from
        device tensors by tensor ops alone, so that a graph can hold it: no host reads, no
        shapes that depend on values. block_table [num_seqs, max_pages] int32 (columns
        past a sequence's pages hold any valid page), num_cached [num_seqs] int32; token i
        of sequence b is at position num_cached[b] + i, packed b-major. Causal, or under
        tree_mask [num_seqs, num_new, W] bool over each sequence's last W keys."""
        raise NotImplementedError(f"the {self.name} attention backend has no graph-safe metadata")

    def uniform_planner(self) -> UniformPlanner | None:
        """A new planner for one graphed step, when this backend's graph passes need one."""
        return None

    def decode_workspace_bytes(self, num_seqs: int, max_keys: int, num_kv_heads: int, head_dim: int,
                               dtype: torch.dtype) -> int:
        """Memory one layer's decode attention allocates beyond its output, for num_seqs
        sequences of up to max_keys keys (what a graph of that batch keeps)."""
        return 0

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], this layer's
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new K/V in the cache, then attend."""


def checked_mask(span: SequenceSpan) -> torch.Tensor:
    """The span's custom mask [num_new, W] as a contiguous CPU bool tensor, after checking its shape."""
    rows, width = span.custom_mask.shape
    if rows != span.num_new or not span.num_new <= width <= span.num_cached + span.num_new:
        raise ValueError(f"custom mask shape {tuple(span.custom_mask.shape)}: expected [{span.num_new}, W] with "
                         f"{span.num_new} <= W <= {span.num_cached + span.num_new}")
    return span.custom_mask.to(device="cpu", dtype=torch.bool).contiguous()


def check_tree_mask(tree_mask: torch.Tensor, num_seqs: int, num_new: int) -> int:
    """The width W of a uniform pass's tree mask [num_seqs, num_new, W], after checking its shape."""
    if tree_mask.dim() != 3 or tuple(tree_mask.shape[:2]) != (num_seqs, num_new) or tree_mask.shape[2] < num_new:
        raise ValueError(f"tree mask shape {tuple(tree_mask.shape)}: expected [{num_seqs}, {num_new}, W >= {num_new}]")
    return tree_mask.shape[2]

def padded_block_table(page_tables: Sequence[Sequence[int]], fill: int = 0) -> torch.Tensor:
    """[num_seqs, longest table (at least 1)] int32 on the host: each row a page table,
    padded with `fill` (numpy arithmetic: cheaper than torch ops on tensors this small)."""
    num_pages = np.fromiter(map(len, page_tables), np.int64, count=len(page_tables))
    table = np.full((len(page_tables), max(1, int(num_pages.max(initial=0)))), fill, dtype=np.int32)
    table[np.arange(table.shape[1]) < num_pages[:, None]] = np.fromiter(chain.from_iterable(page_tables), np.int32)
    return torch.from_numpy(table)


def token_slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_seqs, Q] long: the cache slot of each sequence's tokens at positions [num_seqs, Q]
    (tensor ops only, graph-safe)."""
    positions = positions.long()
    page = block_table.long().gather(1, positions // page_size)
    return page * page_size + positions % page_size


def uniform_positions(num_cached: torch.Tensor, num_new: int) -> torch.Tensor:
    """[num_seqs, num_new] long: the positions of a uniform pass's new tokens."""
    return num_cached.long()[:, None] + torch.arange(num_new, device=num_cached.device)
