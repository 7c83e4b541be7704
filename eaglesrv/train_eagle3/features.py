"""Target features for training, computed once by the frozen target and cached on disk.

For token t of a training sequence the target gives:

    aux[t]     [3H]  inputs of the three capture layers: the draft's features
    hidden[t]  [H]   final-normed hidden state, whose logits predict token t + 1; the
                     trainer turns it into the target's distribution over the draft
                     vocabulary (576 numbers instead of 8,192 logits on disk)
    valid[t]   bool  the prediction of token t + 1 is trained on: t + 1 is reply text and
                     the target's own top token at t is in the draft vocabulary (a draft
                     cannot be taught a token it cannot name; SpecForge masks these too)

The target runs on the engine's own paged forward (any model the engine loads), several
sequences packed per pass. Features are stored in bf16, in shards of whole sequences
(torch.save; read back memory-mapped), listed in manifest.json as they complete, so an
interrupted extraction resumes at the next shard.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.train_eagle3.data import TrainingSequence

STORE_DTYPE = torch.bfloat16
LOGIT_ROWS = 1024  # rows per full-vocabulary logits product (bounds its memory)


@dataclass
class ExtractionStats:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _packs(sequences: Sequence[TrainingSequence], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of consecutive sequences whose tokens fit one forward pass."""
    pack: list[int] = []
    used = 0
    for index, sequence in enumerate(sequences):
        if pack and used + len(sequence.token_ids) > batch_tokens:
            yield pack
            pack, used = [], 0
        pack.append(index)
        used += len(sequence.token_ids)
    if pack:
        yield pack


@torch.inference_mode()
def target_pass(
    engine: Engine, sequences: Sequence[TrainingSequence], capture_layers: tuple[int, ...], covered: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed forward: (aux [N, 3H], hidden [N, H], valid [N], top [N]) on the CPU, N = all tokens."""
    device = engine.device
    hidden, aux = engine.forward_sequences([s.token_ids for s in sequences], capture_layers)
    ids = [t for s in sequences for t in s.token_ids]
    # valid[t]: token t + 1 is reply text (and exists) and the target's argmax is nameable.
    wanted = torch.tensor([m for s in sequences for m in s.loss_mask[1:] + [False]])
    rows = wanted.nonzero().squeeze(1)
    top = torch.full((len(ids),), -1, dtype=torch.int32)
    for chunk in rows.split(LOGIT_ROWS):
        top[chunk] = engine.model.compute_logits(hidden[chunk.to(device)]).argmax(-1).cpu().int()
    valid = (top >= 0) & covered[top.clamp(min=0).long()]
    return aux.to(STORE_DTYPE).cpu(), hidden.to(STORE_DTYPE).cpu(), valid, top


def extract_features(
    engine: Engine,
    sequences: Sequence[TrainingSequence],
    directory: Path,
    fingerprint: str,
    capture_layers: tuple[int, ...],
    covered: torch.Tensor,  # [target_vocab] bool: t2d
    batch_tokens: int,
    shard_tokens: int = 1 << 16,
    progress: bool = True,
) -> ExtractionStats:
    """Fill `directory` with feature shards for every sequence (skips finished shards)."""
    manifest = _read_manifest(directory, fingerprint)
    if manifest.get("complete"):
        return ExtractionStats()
    directory.mkdir(parents=True, exist_ok=True)
    start = sum(shard["sequences"] for shard in manifest["shards"])
    stats = ExtractionStats()
    total_tokens = sum(len(s.token_ids) for s in sequences)
    done_tokens = sum(len(s.token_ids) for s in sequences[:start])
    bar = tqdm(total=total_tokens, initial=done_tokens, desc="target features", unit="tok",
               unit_scale=True, disable=not progress)
    buffer: list[tuple[TrainingSequence, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    buffered_tokens = 0
    for pack in _packs(sequences[start:], batch_tokens):
        batch = [sequences[start + i] for i in pack]
        began = time.monotonic()
        aux, hidden, valid, top = target_pass(engine, batch, capture_layers, covered)
        stats.seconds += time.monotonic() - began
        stats.tokens += len(valid)
        offset = 0
        for sequence in batch:
            n = len(sequence.token_ids)
            rows = slice(offset, offset + n)
            buffer.append((sequence, aux[rows], hidden[rows], valid[rows], top[rows]))
            offset += n
        buffered_tokens += len(valid)
        bar.update(len(valid))
        if buffered_tokens >= shard_tokens:
            _write_shard(directory, manifest, buffer)
            buffer, buffered_tokens = [], 0
    if buffer:
        _write_shard(directory, manifest, buffer)
    manifest["complete"] = True
    _write_manifest(directory, manifest)
    bar.close()
    return stats


def _write_shard(directory: Path, manifest: dict, buffer: list) -> None:
    name = f"shard_{len(manifest['shards']):05d}.pt"
    lengths = torch.tensor([len(item[0].token_ids) for item in buffer])
    tensors = {
        "input_ids": torch.tensor([t for item in buffer for t in item[0].token_ids], dtype=torch.int32),
        "aux": torch.cat([item[1] for item in buffer]),
        "hidden": torch.cat([item[2] for item in buffer]),
        "valid": torch.cat([item[3] for item in buffer]),
        "top": torch.cat([item[4] for item in buffer]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    temporary = directory / (name + ".tmp")
    torch.save(tensors, temporary)
    temporary.rename(directory / name)  # a shard is listed only once it is whole
    manifest["shards"].append({"file": name, "sequences": len(buffer), "tokens": int(lengths.sum())})
    _write_manifest(directory, manifest)


def _read_manifest(directory: Path, fingerprint: str) -> dict:
    path = directory / "manifest.json"
    if path.exists():
        manifest = json.loads(path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return manifest
        raise ValueError(f"{directory} holds features of other data; remove it")
    return {"fingerprint": fingerprint, "shards": [], "complete": False}


def _write_manifest(directory: Path, manifest: dict) -> None:
    temporary = directory / "manifest.json.tmp"
    temporary.write_text(json.dumps(manifest, indent=1))
    temporary.rename(directory / "manifest.json")


class FeatureCache:
    """Read access to the extracted shards of one or more caches, in order: one sequence's
    tensors by index."""

    def __init__(self, directories: Path | Sequence[Path]) -> None:
        self.shards = []
        for directory in [directories] if isinstance(directories, Path) else directories:
            manifest = json.loads((directory / "manifest.json").read_text())
            if not manifest.get("complete"):
                raise ValueError(f"feature cache {directory} is incomplete")
            self.shards += [torch.load(directory / s["file"], mmap=True, weights_only=True) for s in manifest["shards"]]
        self.index: list[tuple[int, int, int]] = []  # (shard, start, end) per sequence
        for shard_id, shard in enumerate(self.shards):
            offsets = shard["offsets"].tolist()
            self.index.extend((shard_id, a, b) for a, b in zip(offsets[:-1], offsets[1:]))

    def __len__(self) -> int:
        return len(self.index)

    def length(self, i: int) -> int:
        _, start, end = self.index[i]
        return end - start

    def get(self, i: int) -> dict[str, torch.Tensor]:
        shard_id, start, end = self.index[i]
        shard = self.shards[shard_id]
        # "top" is absent from caches written before it was stored; only validation reads it
        return {
            name: shard[name][start:end] for name in ("input_ids", "aux", "hidden", "valid", "top") if name in shard
        }
