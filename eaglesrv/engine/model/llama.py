"""One Llama-family decoder on the paged KV cache.

Tokens from all sequences of a step are packed into one [num_tokens] batch; attention is
the only place sequences are told apart (through the ForwardContext's metadata).
Projections are fused (q/k/v into qkv_proj, gate/up into gate_up_proj) and loaded from
the checkpoint's separate tensors by load_weights. Under tensor parallelism each rank
builds and loads only its shard of every layer (sharding.py); its `tp` sums and gathers
the partial results.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.cpu_layout import convert_linears
from eaglesrv.engine.model.rope import RotaryEmbedding
from eaglesrv.engine.model.sharding import checkpoint_slice, held_by_leader_only, per_rank, vocab_parallel
from eaglesrv.engine.parallel.group import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, as Hugging Face does, then scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_id: int, rope: RotaryEmbedding, tp: TensorParallel | None = None) -> None:
        super().__init__()  # arch: this rank's shapes (sharding.per_rank)
        self.layer_id, self.tp = layer_id, tp or TensorParallel.single()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.rope = rope  # shared by every layer; not a parameter
        self.scale = arch.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rope(
            positions,
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
        )
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = ctx.attention.forward(
            q, k, v, ctx.kv.k[self.layer_id], ctx.kv.v[self.layer_id], ctx.metadata, self.scale
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(tokens, self.q_size)))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel | None = None) -> None:
        super().__init__()  # arch: this rank's shapes (sharding.per_rank)
        self.tp = tp or TensorParallel.single()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_id: int, rope: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_id, rope, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """embed_tokens split by vocabulary rows (sharding.py): an id outside this rank's rows
    looks up zeros here, and the all-reduce brings in the row from the rank holding it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.length, padded = tp.vocab_part(vocab_size)
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.length)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.rotary_emb = rope
        shard = per_rank(arch, tp.size)
        self.layers = nn.ModuleList(DecoderLayer(shard, i, rope, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


# Checkpoint tensor -> (fused parameter, which part): q/k/v and gate/up are stored apart.
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.arch = arch  # the whole model's shapes; self.shard holds this rank's
        self.tp = tp or TensorParallel.single()
        self.shard = per_rank(arch, self.tp.size)
        self.model = LlamaModel(arch, self.tp)
        vocab_rows = self.tp.vocab_part(arch.vocab_size)[2]
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, vocab_rows, bias=False)
        self.logits_weight_t: torch.Tensor | None = None  # set by use_input_major_weights

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [num_tokens, hidden_size] and, when
        capture_layers is given, the inputs of those layers side by side
        [num_tokens, len(capture_layers) * hidden_size] (EAGLE-3's features), else None."""
        x = self.model.embed_tokens(input_ids)
        captured = []
        for index, layer in enumerate(self.model.layers):
            if index in capture_layers:
                captured.append(x)
            x = layer(positions, x, ctx)
        if len(captured) != len(capture_layers):
            raise ValueError(f"capture layers {capture_layers} outside 0..{len(self.model.layers) - 1}")
        aux = torch.cat(captured, dim=-1) if captured else None
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        if self.logits_weight_t is not None:
            logits = torch.mm(hidden, self.logits_weight_t)
        else:
            logits = F.linear(hidden, self.output_weight())
        return self.tp.gather_last_dim(logits, self.arch.vocab_size).float()

    def full_embedding(self) -> torch.Tensor:
        """The input embedding [vocab, hidden], gathered from every rank under tensor
        parallelism (for an EAGLE-3 head that shares it: the head runs replicated)."""
        return self.tp.gather_rows(self.model.embed_tokens.weight.detach(), self.arch.vocab_size)

    def output_weight(self) -> torch.Tensor:
        """The output projection as [vocab, hidden] (this rank's rows), whatever its storage."""
        if self.logits_weight_t is not None:
            return self.logits_weight_t.t()
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def use_input_major_weights(self) -> None:
        """After loading: store linear weights [in, out] (see cpu_layout). A tied lm_head
        gets its own transposed copy; the embedding keeps its rows for lookups."""
        convert_linears(self.model)
        self.logits_weight_t = self.output_weight().detach().t().contiguous()
        self.lm_head = None

    # ---- weights ---------------------------------------------------------------------
    def checkpoint_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The part of checkpoint tensor `name` this rank reads (the loaders' SliceChooser)."""
        return checkpoint_slice(name, shape, self.arch, self.tp)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names; under tensor parallelism, the slices
        checkpoint_slice chose) in; refuse missing or mis-shaped ones."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}
        if self.tp.size > 1:
            for name, param in params.items():  # the last rank's vocabulary padding rows stay zero
                if vocab_parallel(name):
                    param.zero_()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, part = fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch.family} model")
            destination = params[target] if part is None else part_view(params[target], target, part, self.shard)
            if held_by_leader_only(name) and not self.tp.is_leader:
                tensor = torch.zeros_like(tensor)
            if self.tp.size > 1 and vocab_parallel(target):
                destination = destination.narrow(0, 0, min(len(destination), len(tensor)))
            if tuple(destination.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(destination.shape)}")
            destination.copy_(tensor)
            loaded.setdefault(target, set()).add(-1 if part is None else part)
        missing = [n for n in params if n not in loaded or not _complete(n, loaded[n])]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for speed runs (--load-format dummy): small normals, unit norms.

        Drawn on the weights' own device: 8B normals drawn on the host took most of a
        minute. The same seed gives the same weights on the CPU as before, other ones on CUDA."""
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.fill_(1.0)
            elif held_by_leader_only(name) and not self.tp.is_leader:
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, device=device) * 0.02
                param.copy_(values.to(param.dtype))


def fused_target(name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (model parameter name, part index within it, or None if unfused)."""
    for part_name, (fused, part) in _FUSED_PARTS.items():
        if f".{part_name}." in name:
            return name.replace(f".{part_name}.", f".{fused}."), part
    return name, None


def fused_part_sizes(name: str, arch: ModelArch) -> list[int]:
    """Row counts of the parts stacked in a fused parameter (q, k, v or gate, up)."""
    if ".gate_up_proj." in name:
        return [arch.intermediate_size] * 2
    return [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2


def part_view(param: torch.Tensor, name: str, part: int, arch: ModelArch) -> torch.Tensor:
    sizes = fused_part_sizes(name, arch)
    return param.narrow(0, sum(sizes[:part]), sizes[part])


def _complete(name: str, parts: set[int]) -> bool:
    if ".qkv_proj." in name:
        return parts == {0, 1, 2}
    if ".gate_up_proj." in name:
        return parts == {0, 1}
    return -1 in parts
