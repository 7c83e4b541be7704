"""Validation: the chain accept length a head would reach at temperature 0, read off
target features of conversations it is not trained on.

Training accuracy misleads twice: a later epoch partly memorizes, and it is counted over
positions whose target token the draft vocabulary can name. Here every reply position
counts, and a hit means what greedy verification accepts: the draft's top token, mapped
to the target's vocabulary, equals the target's own top token (features.py's `top`).

The replies are the target's greedy ones, kept as its own token ids (distill.py), so the
token the data holds after position t is the one the target would commit, and the unroll
fed with the data's tokens is the chain the engine would draft after accepting them
(up to numerics: where the features' pass and the decoding that wrote the reply round
differently, the two can part at a near tie). Root i
(the last committed token is i + 1) accepts k_i drafted tokens, the leading hits of
steps 0, 1, ...; step j at root i is scored against top[i + 1 + j] (ttt.py's indexing).
Roots count when token i + 1 and their S unrolled steps are all reply text: the first
token of a reply comes from the prefill, so the first verification is at the root after it.

Decoding does not verify at every root: after accepting k tokens it moves k + 1 on, so
easy stretches take few verifications and hard ones many. The figures therefore walk the
roots as decoding would (`decoding_walk`); averaging over every root instead overstates
the accept length (the shipped head, chain of 3, on the training split's last 100
conversations: about 1.75 averaged over roots, 1.637 walked, 1.636 served by the engine).
A tree drafts more candidates per depth, so it accepts at least as much as the chain.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.train_eagle3.features import FeatureCache
from eaglesrv.train_eagle3.trainer import collate, plan_epoch
from eaglesrv.train_eagle3.ttt import draft_logits, shift_left, unroll


def chain_acceptance(
    draft: Eagle3DraftModel,
    cache: FeatureCache,  # validation features (greedy replies, `top` stored)
    steps: int,
    batch_tokens: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict:
    """Accept length of chains of 1 .. `steps` drafted tokens, and acceptance by depth."""
    walks = decoding_walks(draft, cache, steps, batch_tokens, device, autocast)
    return summarize({chain: [k for sequence in found for k in sequence] for chain, found in walks.items()})


@torch.no_grad()
def decoding_walks(
    draft: Eagle3DraftModel,
    cache: FeatureCache,
    steps: int,
    batch_tokens: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[int, list[list[int]]]:
    """Per chain length 1 .. `steps`, per sequence (in cache order): the tokens each
    verification of greedy decoding accepts (`decoding_walk`)."""
    was_training = draft.training
    draft.eval()
    draft_to_target = draft.draft_to_target.to(device)
    walks: dict[int, list[list[int]]] = {chain: [[] for _ in range(len(cache))] for chain in range(1, steps + 1)}
    lengths = [cache.length(i) for i in range(len(cache))]
    for indices in plan_epoch(lengths, batch_tokens, seed=0, epoch=0):  # any order: results go by index
        batch = collate(cache, indices, device)
        ids, aux, top = batch["input_ids"], batch["aux"], batch["top"]  # top: [B, T]
        leading = torch.ones_like(top, dtype=torch.bool)  # every step so far hit, root by root
        # A root is verified once its own token i + 1 is a decoded one (top[i] set): the
        # first token of a reply comes from the prefill, not from a verification.
        scored = top >= 0
        accepted = torch.zeros_like(top)
        with autocast():
            for step, hidden in enumerate(unroll(draft, ids, aux, steps)):
                guess = draft_to_target[draft_logits(draft, hidden).argmax(-1)]  # [B, T] target ids
                wanted = shift_left(top, 1 + step, -1)
                scored &= wanted >= 0
                leading &= guess == wanted
                accepted += leading.long()
        for index, row_accepted, row_scored in zip(indices, accepted.tolist(), scored.tolist()):
            for chain, found in walks.items():
                found[index] = decoding_walk(row_accepted, row_scored, chain)
    if was_training:
        draft.train()
    return walks


def decoding_walk(accepted: list[int], scored: list[bool], chain: int) -> list[int]:
    """Tokens accepted at each root greedy decoding with a `chain`-token draft verifies: a
    verification at root i commits k + 1 tokens, so the next one is at root i + k + 1.
    Unscored roots (prompt, reply ends) are stepped over one by one."""
    found, root = [], 0
    while root < len(accepted):
        if not scored[root]:
            root += 1
            continue
        k = min(accepted[root], chain)
        found.append(k)
        root += k + 1
    return found


def summarize(walks: dict[int, list[int]]) -> dict:
    """Accept length per chain length (1 + mean tokens accepted per verification), and the
    longest chain's acceptance by depth (of verifications reaching depth d, the share that
    accept its token)."""
    steps = max(walks)
    longest = walks[steps]
    reached = [sum(k >= d for k in longest) for d in range(steps + 1)]
    return {
        "verifications": len(longest),
        "accept_length_by_steps": [round(1 + sum(walks[c]) / len(walks[c]), 4) if walks[c] else None
                                   for c in range(1, steps + 1)],
        "acceptance_by_depth": [round(reached[d + 1] / reached[d], 4) if reached[d] else None for d in range(steps)],
    }
