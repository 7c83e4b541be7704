"""Training checkpoints that --resume continues exactly.

One file, replaced atomically: the head's trainable weights, the optimizer and LR
schedule, where the data stream stands (epoch, batch within the epoch's seeded plan),
the optimizer step, the RNG states and the fingerprint of the settings it was made
under (a checkpoint never resumes a run with other settings).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class Position:
    """Where training stands: the next batch to run is plan(epoch)[batch]."""

    epoch: int = 0
    batch: int = 0
    step: int = 0  # optimizer steps done


def trainable_state(draft: Eagle3DraftModel) -> dict[str, torch.Tensor]:
    # The embedding is the target's, frozen: not worth 100+ MB per checkpoint.
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}


def save_checkpoint(
    path: Path,
    draft: Eagle3DraftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    position: Position,
    fingerprint: str,
    history_len: int,
) -> None:
    state = {
        "fingerprint": fingerprint,
        "position": asdict(position),
        "model": trainable_state(draft),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "history_len": history_len,  # lines of train_log.jsonl that belong to this state
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    temporary.replace(path)


def load_checkpoint(
    path: Path,
    draft: Eagle3DraftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    fingerprint: str,
) -> tuple[Position, int]:
    """Restore everything in place; returns (position, history_len)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["fingerprint"] != fingerprint:
        raise ValueError(f"checkpoint {path} was made with other training settings; use a fresh --output-dir")
    missing, unexpected = draft.load_state_dict(state["model"], strict=False)
    if unexpected or any(not name.startswith("embed_tokens") for name in missing):
        raise ValueError(f"checkpoint {path} does not fit this head: {missing or unexpected}")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return Position(**state["position"]), state["history_len"]
