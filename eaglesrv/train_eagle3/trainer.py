"""The training loop: seeded batch plans, AdamW with warmup and cosine decay, checkpoints.

Every epoch's batches are a pure function of (seed, epoch): sequences are shuffled, sorted
by length inside windows of WINDOW sequences (little padding), cut into batches of at most
batch_tokens padded tokens, and the batches shuffled. A checkpoint therefore only needs
(epoch, batch) to continue the data stream exactly.

With a validation callback (validate.py), the head is scored before training and after
every epoch; the figures go to the log, the summary and train_state/validation.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.train_eagle3.checkpoint import CHECKPOINT_NAME, Position, load_checkpoint, save_checkpoint
from eaglesrv.train_eagle3.config import TrainConfig
from eaglesrv.train_eagle3.features import FeatureCache
from eaglesrv.train_eagle3.ttt import ttt_loss

WINDOW = 64  # sequences sorted by length together when forming batches
LOG_NAME = "train_log.jsonl"
VALIDATION_NAME = "validation.jsonl"

logger = logging.getLogger(__name__)


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches (sequence indices) of one epoch; the same for the same arguments."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    batches: list[list[int]] = []
    for start in range(0, len(order), WINDOW):
        batch: list[int] = []
        for index in sorted(order[start : start + WINDOW], key=lambda i: lengths[i]):
            # sorted ascending, so the newcomer is the longest: padded size = count * its length
            if batch and (len(batch) + 1) * lengths[index] > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(index)
        if batch:
            batches.append(batch)
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffle]


def collate(cache: FeatureCache, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors; padding is never valid and only later positions see it.
    "top" (where the cache has it) is padded with -1: no token."""
    items = [cache.get(i) for i in indices]
    length = max(len(item["input_ids"]) for item in items)

    def pad(name: str, fill: int = 0) -> torch.Tensor:
        rows = [item[name] for item in items]
        out = rows[0].new_full((len(rows), length) + tuple(rows[0].shape[1:]), fill)
        for b, row in enumerate(rows):
            out[b, : len(row)] = row
        return out.to(device)

    # bf16 on disk; float32 here (the head's master weights; autocast takes it down again)
    batch = {"input_ids": pad("input_ids").long(), "aux": pad("aux").float(), "hidden": pad("hidden").float(),
             "valid": pad("valid")}
    if "top" in items[0]:
        batch["top"] = pad("top", -1).long()
    return batch


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 products run natively (CUDA; CPUs with AVX512-BF16 or AMX, where they
    are about 1.7x faster than float32 for this head's training step)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class TrainSummary:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0  # sequence tokens run through the unroll (padding excluded)
    history: list[dict] = field(default_factory=list)  # one record per optimizer step
    validation: list[dict] = field(default_factory=list)  # before training and after each epoch
    planned_steps: int = 0
    stopped_by_time_limit: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def target_logprobs(hidden: torch.Tensor, target_rows: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The target's log-distribution over the draft vocabulary at `temperature`, from its
    final hidden states [n, H] and its lm_head rows of the draft vocabulary [V, H]."""
    return torch.log_softmax(hidden @ target_rows.T / temperature, dim=-1)


class Trainer:
    def __init__(
        self,
        draft: Eagle3DraftModel,
        target_rows: torch.Tensor,  # [draft_vocab, H] the target's lm_head rows of the draft vocabulary
        cache: FeatureCache,
        config: TrainConfig,
        fingerprint: str,
        device: torch.device,
        validate: Callable[[Eagle3DraftModel], dict] | None = None,  # the head's figures on unseen data
        deadline: float | None = None,  # time.monotonic() past which no step starts (--time-limit)
    ) -> None:
        self.draft, self.cache, self.config, self.device = draft, cache, config, device
        self.validate, self.deadline = validate, deadline
        self.target_rows = target_rows.to(device=device, dtype=torch.float32)
        self.fingerprint = fingerprint
        self.lengths = [cache.length(i) for i in range(len(cache))]
        # Epochs batch differently (each shuffles anew), so each one's plan is counted.
        total = sum(len(plan_epoch(self.lengths, config.batch_tokens, config.seed, epoch))
                    for epoch in range(config.epochs))
        self.total_steps = min(total, config.max_steps) if config.max_steps else total
        params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.state_dir = config.state_path
        amp = config.amp == "bf16" or (config.amp == "auto" and native_bf16(device))
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if amp else contextlib.nullcontext

    def _lr_factor(self, step: int) -> float:
        warmup = min(self.config.warmup_steps, max(1, self.total_steps // 10))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def train(self) -> TrainSummary:
        checkpoint = self.state_dir / CHECKPOINT_NAME
        log_path = self.state_dir / LOG_NAME
        position, history = Position(), []
        if checkpoint.exists():
            if not self.config.resume:
                raise FileExistsError(f"{checkpoint} exists: pass --resume to continue it, or use a fresh --output-dir")
            position, kept = load_checkpoint(checkpoint, self.draft, self.optimizer, self.scheduler, self.fingerprint)
            history = [json.loads(line) for line in log_path.read_text().splitlines()[:kept]]
        self._write_log(log_path, history)
        summary = TrainSummary(history=history, validation=self._kept_validations(position, checkpoint.exists()),
                               planned_steps=self.total_steps)
        if position.step == 0 and not summary.validation:
            self._validate(0, summary)
        bar = tqdm(total=self.total_steps, initial=position.step, desc="train", unit="step",
                   disable=not self.config.progress)
        self.draft.train()
        while position.step < self.total_steps and position.epoch < self.config.epochs:
            plan = plan_epoch(self.lengths, self.config.batch_tokens, self.config.seed, position.epoch)
            tick = time.monotonic()  # steps are timed wall to wall: waiting for a batch counts
            for indices, batch in self._collated(plan, position.batch):
                if position.step >= self.total_steps:
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    summary.stopped_by_time_limit = True
                    break
                record = self._step(indices, batch, position)
                now = time.monotonic()
                record["seconds"], tick = now - tick, now
                position.batch += 1
                position.step += 1
                summary.steps += 1
                summary.seconds += record["seconds"]
                summary.tokens += record["tokens"]
                history.append(record)
                with log_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['step_acc'][0]:.3f}")
                if position.step % self.config.checkpoint_every == 0:
                    self._save(checkpoint, position, len(history))
            if summary.stopped_by_time_limit:
                logger.info("time limit: stopped after %d of %d steps (--resume continues)",
                            position.step, self.total_steps)
                break
            if position.batch >= len(plan):
                position.epoch += 1
                position.batch = 0
                self._validate(position.epoch, summary)
        bar.close()
        if self.validate and summary.validation and summary.validation[-1]["step"] != len(history):
            self._validate(position.epoch, summary)  # stopped inside an epoch (--max-steps, --time-limit)
        self._save(checkpoint, position, len(history))
        self.draft.eval()
        return summary

    def _collated(self, plan: list[list[int]], start: int) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """(indices, batch) for plan[start:]; each batch is collated in a worker thread while
        the one before it trains (on a GPU, the host-side padding would stall every step)."""
        with ThreadPoolExecutor(max_workers=1) as worker:
            upcoming = worker.submit(collate, self.cache, plan[start], self.device) if start < len(plan) else None
            for k in range(start, len(plan)):
                batch = upcoming.result()
                if k + 1 < len(plan):
                    upcoming = worker.submit(collate, self.cache, plan[k + 1], self.device)
                yield plan[k], batch

    def _step(self, indices: list[int], batch: dict[str, torch.Tensor], position: Position) -> dict:
        with torch.no_grad():
            target = torch.zeros(batch["valid"].shape + (len(self.target_rows),), device=self.device)
            rows = batch["hidden"][batch["valid"]].float()
            target[batch["valid"]] = target_logprobs(rows, self.target_rows, self.config.target_temperature)
        with self.autocast():
            result = ttt_loss(self.draft, batch["input_ids"], batch["aux"], target, batch["valid"],
                              self.config.ttt_steps, self.config.loss_decay)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.draft.parameters() if p.requires_grad], self.config.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return {
            "step": position.step + 1,
            "epoch": position.epoch,
            "lr": lr,
            "loss": float(result.loss.detach()),
            "step_loss": [round(x, 5) for x in result.step_losses],
            "step_kl": [round(x, 5) for x in result.step_kl],
            "step_acc": [c / n if n else 0.0 for c, n in zip(result.step_correct, result.step_counts)],
            "step_count": result.step_counts,
            "grad_norm": float(grad_norm),
            "sequences": len(indices),
            "tokens": sum(self.lengths[i] for i in indices),
        }

    def _validate(self, epochs: int, summary: TrainSummary) -> None:
        if self.validate is None:
            return
        record = {"epochs": epochs, "step": len(summary.history), **self.validate(self.draft)}
        summary.validation.append(record)
        with (self.state_dir / VALIDATION_NAME).open("a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("validation at step %d (%d whole epoch(s)): chain accept length %s for 1..%d steps, "
                    "acceptance by depth %s", record["step"], epochs, record["accept_length_by_steps"],
                    len(record["accept_length_by_steps"]), record["acceptance_by_depth"])

    def _kept_validations(self, position: Position, resumed: bool) -> list[dict]:
        """On resume, the validations of heads up to the checkpoint's (later ones are redone);
        the file is rewritten."""
        path = self.state_dir / VALIDATION_NAME
        records = [json.loads(line) for line in path.read_text().splitlines()] if resumed and path.exists() else []
        kept = [r for r in records if r["step"] <= position.step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def _save(self, path: Path, position: Position, history_len: int) -> None:
        save_checkpoint(path, self.draft, self.optimizer, self.scheduler, position, self.fingerprint, history_len)

    @staticmethod
    def _write_log(path: Path, history: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(record) + "\n" for record in history))
