"""Choosing what to keep from a verified draft tree.

Glossary (per request, per verification):
  root      the last accepted token; its K/V are written by this verification
  accepted  draft nodes on the kept path, root excluded
  bonus     the token the target itself picks after the last accepted node
  accept length = len(accepted) + 1, the tokens one verification adds (SGLang's measure)

Greedy: walk down from the root while some child carries the target's argmax.

Sampling (temperature > 0), using only the target's distributions p (after temperature,
top-k, top-p, min-p). At a node, try its children in order. A child with token t is
accepted with probability p(t); if refused, t's mass is removed and p renormalised. If
every child is refused, the bonus is drawn from what is left. Each test is exact
rejection sampling against a point-mass proposal, so the emitted token is distributed as
p whatever the draft proposed; after an acceptance the walk continues with the target's
distribution at that child, which is the target's distribution given the new prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglesrv.engine.sampler import draw_from_probs


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root excluded, in order
    bonus: int  # the target's own next token after the path

    def tokens(self, node_tokens: list[int]) -> list[int]:
        return [node_tokens[node] for node in self.path] + [self.bonus]


def accept_greedy(node_tokens: list[int], children: list[list[int]], target_argmax: list[int]) -> Acceptance:
    """target_argmax[i]: the target's greedy choice after node i."""
    node, path = 0, []
    while True:
        want = target_argmax[node]
        match = next((c for c in children[node] if node_tokens[c] == want), None)
        if match is None:
            return Acceptance(path, want)
        path.append(match)
        node = match


def accept_sampling(
    node_tokens: list[int],
    children: list[list[int]],
    target_probs: torch.Tensor,  # [N, V] float, processed target distribution after each node
    uniforms_for_step,  # callable: output index offset -> tensor of uniforms for that token
) -> Acceptance:
    """uniforms_for_step(d) gives the uniforms for the d-th token this verification emits."""
    node, path = 0, []
    while True:
        probs = target_probs[node].double().clone()
        uniforms = uniforms_for_step(len(path)).tolist()
        draw = 0
        accepted = None
        for child in children[node]:
            token = node_tokens[child]
            total = probs.sum().item()
            if total <= 0.0:
                break
            if uniforms[draw] * total < probs[token].item():
                accepted = child
                break
            draw += 1
            probs[token] = 0.0  # refused: sample the rest from the remaining mass
        if accepted is None:  # the bonus: u scaled to the mass the refusals left
            remaining = torch.tensor([uniforms[draw] * probs.sum().item()], dtype=torch.float64)
            return Acceptance(path, int(draw_from_probs(probs.unsqueeze(0), remaining)))
        path.append(accepted)
        node = accepted

