"""The target's decode step in graphs: one new token per request in, logits out.

A decode-only step (every sequence adds one token and samples it) replays the graph of
the smallest rung that holds its batch. Anything else (prefill chunks, draft trees,
batches above the top rung, page tables wider than the graphs were captured for) runs
eagerly through the same model.

The inputs, one row per request: the token id, the cached length (which is also the new
token's position) and the request's row of the block table. Padding rows hold the KV
pool's padding page in every column and a cached length of 0, so they write and read that
page only. The attention backend builds its metadata from these tensors inside the graph
(`AttentionBackend.uniform_metadata`): nothing in the step reads a tensor on the host.

With `capture_layers` (an EAGLE-3 server's plain steps), the step also returns the
target's features at those layers, which the draft extend or the adaptive backlog needs.

Sampling runs after the replay, outside the graph (the sampler still branches on
per-request parameters in Python; see the package doc).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.graphs.capture import CaptureMechanism
from eaglesrv.engine.graphs.runner import GraphRunner, StaticInput
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.kernels.attention.base import AttentionBackend, padded_block_table
from eaglesrv.scheduler.batch import SequenceWork


class DecodeGraphs:
    def __init__(
        self, target: LlamaForCausalLM, kv: KVPool, attention: AttentionBackend, device: torch.device,
        max_batch_size: int, max_pages: int, mechanism: CaptureMechanism | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        """`max_pages`: the widest page table a graph takes (a longer one runs eagerly)."""
        if not attention.graph_safe:
            raise ValueError(f"the {attention.name} attention backend cannot run in a graph")
        self.target = target
        self.kv = kv
        self.attention = attention
        self.device = device
        self.capture_layers = capture_layers
        inputs = {
            "token_ids": StaticInput((), torch.long),
            "num_cached": StaticInput((), torch.int32),
            "block_table": StaticInput((max_pages,), torch.int32, pad_value=kv.padding_page),
        }
        self.runner = GraphRunner(self._step, inputs, max_batch_size, device, mechanism=mechanism,
                                  planner=attention.uniform_planner())

    @property
    def batch_sizes(self) -> list[int]:
        return self.runner.batch_sizes

    def capture(self) -> None:
        self.runner.capture()

    @staticmethod
    def holds(sequences: Sequence[SequenceWork]) -> bool:
        """Whether a step's sequences are a decode-only batch."""
        return bool(sequences) and all(seq.sample and len(seq.token_ids) == 1 for seq in sequences)

    def logits(self, sequences: Sequence[SequenceWork]) -> torch.Tensor:
        """[num_seqs, vocab] float32 logits of a decode-only batch. After a replay this is a
        view of the graph's static output: read it before the next call."""
        return self._run(sequences)

    def logits_and_features(self, sequences: Sequence[SequenceWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and [num_seqs, len(capture_layers) * hidden] features (with capture_layers)."""
        return self._run(sequences)

    def _run(self, sequences: Sequence[SequenceWork]):
        token_ids = torch.tensor([seq.token_ids[0] for seq in sequences], dtype=torch.long)
        num_cached = torch.tensor([seq.num_cached for seq in sequences], dtype=torch.int32)
        table = padded_block_table([seq.page_table for seq in sequences], self.kv.padding_page)
        return self.runner.run({"token_ids": token_ids, "num_cached": num_cached, "block_table": table})

    def _step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_cached = inputs["num_cached"]
        metadata = self.attention.uniform_metadata(inputs["block_table"], num_cached, 1)
        context = ForwardContext(self.attention, metadata, self.kv)
        hidden, features = self.target(inputs["token_ids"], num_cached.long(), context, self.capture_layers)
        logits = self.target.compute_logits(hidden)
        return (logits, features) if self.capture_layers else logits


def decode_graph_bytes(arch: ModelArch, dtype: torch.dtype, max_batch_size: int, attention: AttentionBackend,
                       max_keys: int) -> int:
    """An estimate of the memory plain decoding's graphs keep: the intermediates of one
    decode step at the largest batch (graphs are captured largest first into one shared
    pool, so the smaller ones reuse its memory) and the attention backend's workspace.
    Per row: the residual stream and its norms, q/k/v, the attention output, the MLP's
    gate/up and their product, and the logits in the model's dtype and in float32."""
    element = dtype.itemsize
    q_width, kv_width = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_row = element * (3 * arch.hidden_size + 2 * q_width + 2 * kv_width + 3 * arch.intermediate_size)
    per_row += (element + 4) * arch.vocab_size
    workspace = attention.decode_workspace_bytes(max_batch_size, max_keys, arch.num_kv_heads, arch.head_dim, dtype)
    return max_batch_size * per_row + workspace
