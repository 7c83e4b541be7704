"""The EAGLE-3 training-time test: the draft unrolled over its own outputs, dense attention.

Index i of a training sequence x_0 .. x_{T-1}, unroll step j = 0 .. S-1:

    step 0   reads token x_{i+1} and the target's features f_i (through fc), at position i
    step j   reads token x_{i+1+j} and its own step-(j-1) output at index i, at position i+j
    both     predict x_{i+2+j}; the target is the target model's distribution at i+1+j

This is what the engine does at inference (engine/eagle3/runner.py). Step 0 is the draft
extend over committed tokens: draft position p reads token p+1 and the target's features
of p. A chain of draft passes from root r = i+1 reads, at depth j, the token drafted at
depth j-1 and its own previous output, at position r+j-1 = i+j.

Attention of the query at step j, index i:

                 step-0 keys (T)             step-1 keys   ...   step-j keys
    query i   [ 1 .. 1 (keys 0..i) 0 .. 0 ]  [ only i ]    ...   [ only i ]

the causal prefix of step-0 keys (the draft KV the extend wrote for committed tokens)
plus, from each later step, the key at its own index (its ancestors in the chain, and
itself). Checked against SpecForge's flex-attention mask (causal first block, diagonal
of every later block, RoPE position + step) as of its PR #245, which dropped the original
cnets.py's extra shrinking of the causal block (there query i at step j saw only keys
0 .. i-j, unlike the inference-time draft); and tested here, logit for logit, against
the engine's paged draft (tests/test_train_eagle3.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel


def shift_left(x: torch.Tensor, n: int, fill: float | bool | int) -> torch.Tensor:
    """x[:, n:] along dim 1, padded at the end with `fill` to the same length."""
    if n == 0:
        return x
    tail = torch.full_like(x[:, : min(n, x.shape[1])], fill)
    return torch.cat([x[:, n:], tail], dim=1)


def unroll(
    draft: Eagle3DraftModel,
    input_ids: torch.Tensor,  # [B, T] token ids x_t (anything past a sequence's end)
    aux: torch.Tensor,  # [B, T, 3 * target_hidden] target features f_t
    steps: int,
    live: list[torch.Tensor] | None = None,  # per step [B, T] bool: rows a later loss reads
) -> Iterator[torch.Tensor]:
    """Yields the draft's pre-norm output [B, T, H] of every unroll step, in order.

    With `live`, the layer runs only on live rows (zeros elsewhere), except that step 0
    computes keys and values everywhere: every later query attends to them. Rows past
    the last trained position, prompts and padding are most of what this skips.
    """
    batch, length = input_ids.shape
    layer = draft.midlayer
    attn = layer.self_attn
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    everywhere = torch.ones(batch, length, dtype=torch.bool, device=input_ids.device)
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    hidden = draft.project_features(aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for step in range(steps):
        out_rows = everywhere if live is None else live[step]
        kv_rows = everywhere if step == 0 else out_rows
        tokens = shift_left(input_ids, 1 + step, 0)[kv_rows]
        x = torch.cat([layer.input_layernorm(draft.embed_tokens(tokens)), layer.hidden_norm(hidden[kv_rows])], -1)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = draft.rotary_emb(positions[kv_rows] + step, q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim))
        keys.append(_scatter_heads(k, kv_rows, heads // kv_heads))
        values.append(_scatter_heads(v.view(-1, kv_heads, head_dim), kv_rows, heads // kv_heads))
        out = _attend(_scatter_heads(q, kv_rows, 1), keys, values, attn.scale)  # [B, heads, T, D]
        rows = hidden[out_rows] + attn.o_proj(out.transpose(1, 2)[out_rows].reshape(-1, heads * head_dim))
        rows = rows + layer.mlp(layer.post_attention_layernorm(rows))
        hidden = rows.new_zeros(hidden.shape).index_put((out_rows,), rows) if live is not None else rows.view_as(hidden)
        yield hidden


def live_rows(valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per step, the rows whose output some loss at this step or a later one reads:
    row i at step j feeds positions i+1+j .. i+steps of `valid` (the chain goes on at i)."""
    live = [shift_left(valid, steps, False)]
    for step in range(steps - 2, -1, -1):
        live.insert(0, live[0] | shift_left(valid, 1 + step, False))
    return live


def _scatter_heads(x: torch.Tensor, rows: torch.Tensor, repeat: int) -> torch.Tensor:
    """[N, h, D] values of the True rows of `rows` [B, T] -> [B, h*repeat, T, D], zeros
    elsewhere; kv head g serves query heads g*repeat .. (as SDPA's GQA does)."""
    full = x.new_zeros(rows.shape + x.shape[1:]).index_put((rows,), x) if x.shape[0] != rows.numel() else x
    full = full.view(rows.shape + x.shape[1:]).transpose(1, 2)
    return full.repeat_interleave(repeat, dim=1) if repeat > 1 else full


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Causal attention over step-0 keys plus the own-index key of each later step."""
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scale)
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    prefix = (q @ keys[0].transpose(-1, -2)).mul(scale).masked_fill(~causal, float("-inf"))  # [B, h, T, T]
    diagonal = torch.stack([(q * k).sum(-1) for k in keys[1:]], dim=-1).mul(scale)  # [B, h, T, j]
    probs = torch.softmax(torch.cat([prefix, diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :length] @ values[0]
    return out + (probs[..., length:].unsqueeze(-1) * torch.stack(values[1:], dim=-2)).sum(-2)


def draft_logits(draft: Eagle3DraftModel, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] pre-norm output -> [..., draft_vocab] logits, as the engine computes them."""
    return draft.logits(hidden)


@dataclass
class TTTResult:
    loss: torch.Tensor  # weighted sum over steps, for backward
    step_losses: list[float] = field(default_factory=list)  # soft cross-entropy per step
    step_kl: list[float] = field(default_factory=list)  # the part of it above the target's entropy
    step_correct: list[int] = field(default_factory=list)  # draft top-1 == target top-1 (draft vocab)
    step_counts: list[int] = field(default_factory=list)  # positions trained at each step


def ttt_loss(
    draft: Eagle3DraftModel,
    input_ids: torch.Tensor,  # [B, T]
    aux: torch.Tensor,  # [B, T, 3H]
    target_logprobs: torch.Tensor,  # [B, T, draft_vocab] target log-probs at t (of token t+1), draft vocab only
    valid: torch.Tensor,  # [B, T] bool: the prediction made at t is trained on
    steps: int,
    decay: float,
) -> TTTResult:
    """Soft cross-entropy to the target at every unroll step, weighted decay ** step.

    At step j the draft at index i predicts the token after position i+1+j, so its
    target and mask are those of position i+1+j. Logits are computed only at trained
    positions: the lm_head is the head's largest product.
    """
    result = TTTResult(loss=torch.zeros((), device=aux.device))
    live = live_rows(valid, steps)
    for step, hidden in enumerate(unroll(draft, input_ids, aux, steps, live)):
        mask = shift_left(valid, 1 + step, False)
        count = int(mask.sum())
        if count == 0:
            result.step_losses.append(0.0)
            result.step_kl.append(0.0)
            result.step_correct.append(0)
            result.step_counts.append(0)
            continue
        target = shift_left(target_logprobs, 1 + step, 0.0)[mask]  # [n, V]
        logq = torch.log_softmax(draft_logits(draft, hidden[mask]).float(), dim=-1)
        probs = target.exp()
        loss = -(probs * logq).sum(-1).mean()
        result.loss = result.loss + decay**step * loss
        result.step_losses.append(float(loss.detach()))
        entropy = -(probs * target).sum(-1).mean()  # the floor of the loss: 0 KL
        result.step_kl.append(float(loss.detach() - entropy))
        result.step_correct.append(int((logq.argmax(-1) == target.argmax(-1)).sum()))
        result.step_counts.append(count)
    return result
