#!/usr/bin/env bash
# Pilot: do extra sampled replies per prompt teach the head as much as new prompts do?
# Three heads from scratch, equal settings, 3 epochs each, validated on the training
# split's last 100 conversations (greedy chain accept length, train_eagle3 --val-conversations):
#   A  250 conversations, greedy replies
#   B  the same 250, greedy replies plus one sampled reply each (T = 0.8): A's prompts, twice the tokens
#   C  500 conversations, greedy replies: twice A's prompts, about B's tokens
# First, the shipped head on the same validation set (before its one training step).
# Usage: bash scripts/pilot_reply_sets.sh [OUT_DIR]   (about an hour on a 2-core CPU; figures: docs/training_pilots.md)
set -euo pipefail
out=${1:-bench_out/pilot_reply_sets}
work=${WORK_DIR:-$out/work}
mkdir -p "$out"
common=(--self-distill --max-turns 1 --distill-max-new-tokens 256 --distill-batch-size 64 --max-seq-len 512
        --ttt-steps 5 --lr 6e-4 --warmup-steps 30 --batch-tokens 2048 --seed 0 --val-conversations 100
        --work-dir "$work" --no-progress)
train() { name=$1; shift; rm -rf "$out/$name"; python -m eaglesrv.train_eagle3 --output-dir "$out/$name" "${common[@]}" "$@" \
          2>&1 | grep -E "validation after|head written|vocabulary" | tee "$out/$name.log"; }
train shipped --init-from eaglesrv/heads/smollm2-135m-eagle3 --conversation-offset 3776 --num-conversations 16 --max-steps 1
train A --draft-vocab-size 4096 --conversation-offset 3776 --num-conversations 250 --epochs 3
train B --draft-vocab-size 4096 --conversation-offset 3776 --num-conversations 250 --epochs 3 --distill-extra-samples 1
train C --draft-vocab-size 4096 --conversation-offset 3776 --num-conversations 500 --epochs 3
