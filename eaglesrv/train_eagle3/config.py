"""Every setting of one training run, in one frozen dataclass (the CLI fills it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAVE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    data_path: str | None = None  # a ShareGPT-format JSON array; None: the shipped file
    work_dir: str | None = None  # caches (distilled data, features); None: <output_dir>/work
    # data
    num_conversations: int | None = None  # None: all 8,000 training conversations
    conversation_offset: int = 0  # skip this many first (e.g. to train a head further on unseen ones)
    max_seq_len: int = 512
    max_turns: int | None = None  # assistant turns kept per conversation; None: all that fit
    self_distill: bool = False
    distill_temperature: float = 0.0  # 0: greedy replies
    distill_batch_size: int = 32  # conversations generated together
    distill_max_new_tokens: int | None = None  # cap per regenerated reply; None: what max_seq_len leaves
    distill_extra_samples: int = 0  # more replies per conversation, sampled: more of the target's contexts
    distill_extra_temperature: float = 0.8
    reply_sets: tuple[int, ...] | None = None  # the reply sets trained on (0: the first, 1 ..: the extra); None: all
    distill_only: bool = False  # fill the reply caches and stop (prepare data here, train elsewhere)
    val_conversations: int = 0  # the training split's last N, never trained on: greedy chain acceptance per epoch
    # draft head
    draft_vocab_size: int = 8192
    ttt_steps: int = 7
    init_from: str | None = None  # start from this head's weights and draft vocabulary (same target)
    grow_draft_vocab: int | None = None  # with init_from: add the most frequent missing reply tokens up to this size
    lm_head_init: str = "random"  # random: N(0, 0.02) (SpecForge; better in our pilot); target: its own rows
    save_dtype: str = "bfloat16"  # of the written head: half the file of float32, as published heads ship
    loss_decay: float = 0.8  # weight of unroll step j is loss_decay ** j (EAGLE-3's choice)
    target_temperature: float = 1.0  # the loss's target is the target's distribution at this temperature
    # optimisation
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (pilots)
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096  # padded tokens per optimizer step
    checkpoint_every: int = 200  # optimizer steps
    seed: int = 0
    resume: bool = False
    time_limit: float | None = None  # seconds for the whole run: training stops there, the head is written as it is
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    target_dtype: str = "auto"  # the frozen target's compute dtype (engine semantics)
    amp: str = "auto"  # auto: bf16 autocast on CUDA and on CPUs with native bf16, else none; or bf16 | none
    num_threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.max_seq_len >= 8, "--max-seq-len must be at least 8"),
            (self.draft_vocab_size >= 2, "--draft-vocab-size must be at least 2"),
            (self.ttt_steps >= 1, "--ttt-steps must be at least 1"),
            (self.target_temperature > 0, "--target-temperature must be > 0"),
            (self.epochs >= 1, "--epochs must be at least 1"),
            (self.batch_tokens >= self.max_seq_len, "--batch-tokens must be at least --max-seq-len"),
            (self.checkpoint_every >= 1, "--checkpoint-every must be at least 1"),
            (self.amp in ("auto", "bf16", "none"), "--amp must be auto, bf16 or none"),
            (self.lm_head_init in ("target", "random"), "--lm-head-init must be target or random"),
            (self.save_dtype in SAVE_DTYPES, f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}"),
            (self.num_conversations is None or self.num_conversations >= 1, "--num-conversations must be >= 1"),
            (self.conversation_offset >= 0, "--conversation-offset must be >= 0"),
            (self.max_turns is None or self.max_turns >= 1, "--max-turns must be >= 1"),
            (self.distill_extra_samples >= 0, "--distill-extra-samples must be >= 0"),
            (self.distill_extra_samples == 0 or self.self_distill, "--distill-extra-samples needs --self-distill"),
            (self.distill_extra_temperature > 0, "--distill-extra-temperature must be > 0"),
            (self.reply_sets is None or self.self_distill, "--reply-sets needs --self-distill"),
            (self.reply_sets is None or (len(self.reply_sets) > 0 and len(set(self.reply_sets)) == len(self.reply_sets)
                                         and all(0 <= s <= self.distill_extra_samples for s in self.reply_sets)),
             f"--reply-sets must name distinct sets among 0 .. {self.distill_extra_samples} (--distill-extra-samples)"),
            (self.val_conversations >= 0, "--val-conversations must be >= 0"),
            (self.time_limit is None or self.time_limit >= 0, "--time-limit must be >= 0"),
            (not self.distill_only or self.self_distill, "--distill-only needs --self-distill"),
            (self.grow_draft_vocab is None or self.init_from is not None, "--grow-draft-vocab needs --init-from"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def work_path(self) -> Path:
        """Caches, each named by the settings it depends on: runs may share one."""
        return Path(self.work_dir) if self.work_dir else Path(self.output_dir) / "work"

    @property
    def state_path(self) -> Path:
        """This run's checkpoint and per-step log."""
        return Path(self.output_dir) / "train_state"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, *fields: str, **extra: Any) -> str:
        """A short hash of the named settings (and `extra` values): caches are reused only
        when these match."""
        chosen = {name: getattr(self, name) for name in fields} | extra
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]

    def distill_fingerprint(self, sample: int = 0) -> str:
        """The key of the self-distillation cache of reply set `sample` (0: the replies at
        --distill-temperature; 1 ..: the extra sampled ones), whose entries are whole
        conversations by their index in the file: runs over any slice of the data share it.
        The seed enters only when replies are sampled: a greedy run under a new seed reuses them."""
        if sample > 0:  # these replies do not depend on the first set's temperature
            fields = [name for name in DISTILL_FIELDS if name != "distill_temperature"]
            return self.fingerprint(*fields, "distill_extra_temperature", distill_format=DISTILL_FORMAT) + f"-s{sample}"
        if self.self_distill and self.distill_temperature > 0:
            return self.fingerprint(*DISTILL_FIELDS, distill_format=DISTILL_FORMAT)
        return dataclasses.replace(self, seed=0).fingerprint(*DISTILL_FIELDS, distill_format=DISTILL_FORMAT)

    @property
    def used_reply_sets(self) -> tuple[int, ...]:
        """The reply sets this run distills and trains on, in order."""
        if self.reply_sets is not None:
            return tuple(sorted(self.reply_sets))
        return tuple(range(1 + self.distill_extra_samples))

    def sample_seed(self, sample: int) -> int:
        """The seed reply set `sample` is drawn under (set 0: --seed itself)."""
        if sample == 0:
            return self.seed
        return int(hashlib.sha256(f"{self.seed}/{sample}".encode()).hexdigest()[:8], 16)

    def greedy_distill(self) -> TrainConfig:
        """These settings with greedy self-distillation: the validation replies' (they mirror
        temperature-0 serving whatever the training data is), sharing a greedy run's cache."""
        return dataclasses.replace(self, self_distill=True, distill_temperature=0.0)


# Version of the distillation caches. 2: each reply keeps the target's token ids (distill.py);
# 3: prompts from GGUF tokenizers split digits as the original tokenizer does (gguf_file.py).
DISTILL_FORMAT = 3
# Settings that decide one conversation's regenerated replies (the distillation caches' key).
DISTILL_FIELDS = ("model_path", "data_path", "max_seq_len", "max_turns", "self_distill", "distill_temperature",
                  "distill_max_new_tokens", "seed")
# Settings that decide the training sequences (and so every cache built from them).
DATA_FIELDS = DISTILL_FIELDS + ("num_conversations", "conversation_offset", "distill_extra_samples",
                                "distill_extra_temperature", "reply_sets", "val_conversations")
# Settings that decide the optimisation trajectory: a checkpoint resumes only under the same.
RUN_FIELDS = DATA_FIELDS + ("draft_vocab_size", "ttt_steps", "init_from", "grow_draft_vocab", "lm_head_init",
                            "loss_decay", "target_temperature", "epochs", "max_steps", "lr", "warmup_steps",
                            "weight_decay", "grad_clip", "batch_tokens", "amp")
