"""The draft vocabulary: the target tokens the head can propose.

The head's lm_head covers only `draft_vocab_size` target tokens, the ones that most often
appear in assistant replies of the training data (what the draft has to predict). A draft
that cannot name a token cannot get it accepted, so coverage of reply tokens is the
figure to watch; it is logged and recorded with the run.

Published format (SpecForge, SGLang, vLLM): draft ids are the chosen target ids in
ascending order; d2t[d] = target_id - d (an offset), t2d is a bool mask over the target
vocabulary. The engine holds draft_to_target = arange + d2t.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from eaglesrv.train_eagle3.data import TrainingSequence


@dataclass(frozen=True)
class DraftVocab:
    draft_to_target: torch.Tensor  # [draft_vocab] target id of each draft id, ascending
    coverage: float  # share of reply tokens in the training data that the draft can name

    @property
    def size(self) -> int:
        return len(self.draft_to_target)

    def target_mask(self, target_vocab_size: int) -> torch.Tensor:
        """t2d: [target_vocab] bool, True for target ids the draft covers."""
        mask = torch.zeros(target_vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask


def build_draft_vocab(sequences: Sequence[TrainingSequence], size: int, target_vocab_size: int) -> DraftVocab:
    """The `size` most frequent reply tokens (ties by id); unseen ids fill any gap."""
    return _with_most_frequent(set(), sequences, size, target_vocab_size)


def grown_vocab(draft_to_target: torch.Tensor, sequences: Sequence[TrainingSequence], size: int,
                target_vocab_size: int) -> DraftVocab:
    """An existing vocabulary with the most frequent reply tokens it lacks added, up to
    `size`: every token it had stays."""
    kept = set(draft_to_target.tolist())
    if size <= len(kept):
        raise ValueError(f"--grow-draft-vocab {size} must be larger than the head's vocabulary of {len(kept)}")
    return _with_most_frequent(kept, sequences, size, target_vocab_size)


def _with_most_frequent(kept: set[int], sequences: Sequence[TrainingSequence], size: int,
                        target_vocab_size: int) -> DraftVocab:
    """`kept` and the most frequent other reply tokens (ties by id), `size` in all."""
    if size > target_vocab_size:
        raise ValueError(f"draft vocabulary {size} is larger than the target's {target_vocab_size}")
    counts = reply_counts(sequences)
    added = sorted((t for t in counts if t not in kept), key=lambda t: (-counts[t], t))[: size - len(kept)]
    chosen = kept | set(added)
    # Too few distinct reply tokens: pad with the lowest unused ids, so the size is as asked.
    filler = (t for t in range(target_vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return vocab_of(torch.tensor(sorted(chosen), dtype=torch.long), sequences, counts)


def vocab_of(draft_to_target: torch.Tensor, sequences: Sequence[TrainingSequence],
             counts: Counter[int] | None = None) -> DraftVocab:
    """A given vocabulary (e.g. an existing head's) with its coverage of these replies."""
    counts = counts if counts is not None else reply_counts(sequences)
    chosen = set(draft_to_target.tolist())
    total = sum(counts.values())
    covered = sum(n for t, n in counts.items() if t in chosen)
    return DraftVocab(draft_to_target, covered / total if total else 0.0)


def reply_counts(sequences: Sequence[TrainingSequence]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for sequence in sequences:
        counts.update(t for t, is_reply in zip(sequence.token_ids, sequence.loss_mask) if is_reply)
    return counts
