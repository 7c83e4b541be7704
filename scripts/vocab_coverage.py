"""How much of the target's replies a draft vocabulary holds, and what growing it would add.

A draft token outside the vocabulary is never proposed, so the share of reply tokens the
vocabulary holds caps every depth's acceptance. This reads a self-distillation cache
(`train_eagle3 --self-distill` writes it under --work-dir), grows the head's vocabulary
with `--grow-draft-vocab`'s rule on the replies of the first --fit-conversations, and
scores each size on the replies of the rest (tokens the growth did not see):

    python scripts/vocab_coverage.py --distill-cache HEAD/work/distill-KEY.jsonl \
        --head eaglesrv/heads/smollm2-135m-eagle3 --fit-conversations 7000 --sizes 6144 8192 12288
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglesrv.train_eagle3.data import REPLY_IDS, TrainingSequence
from eaglesrv.train_eagle3.distill import read_cache
from eaglesrv.train_eagle3.vocab import grown_vocab, vocab_of


def replies(cache_file: str) -> dict[int, list[TrainingSequence]]:
    """Each cached conversation's replies, as all-reply training sequences, by index."""
    return {index: [TrainingSequence(m[REPLY_IDS], [True] * len(m[REPLY_IDS])) for m in messages if REPLY_IDS in m]
            for index, messages in read_cache(Path(cache_file)).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--distill-cache", required=True, help="a distill-*.jsonl file")
    p.add_argument("--head", required=True, help="the head whose vocabulary is grown")
    p.add_argument("--fit-conversations", type=int, required=True,
                   help="grow on the replies of the cache's first N conversations, score on the rest")
    p.add_argument("--sizes", type=int, nargs="+", default=[6144, 8192, 12288, 16384])
    args = p.parse_args()
    by_index = replies(args.distill_cache)
    order = sorted(by_index)
    fit = [s for i in order[: args.fit_conversations] for s in by_index[i]]
    scored = [s for i in order[args.fit_conversations :] for s in by_index[i]]
    if not fit or not scored:
        raise SystemExit(f"the cache holds {len(order)} conversations: --fit-conversations leaves one side empty")
    tensors = load_file(f"{args.head}/model.safetensors")
    head_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    vocab_size = len(tensors["t2d"])
    print(f"grown on {sum(len(s.token_ids) for s in fit):,} reply tokens ({args.fit_conversations} conversations), "
          f"scored on {sum(len(s.token_ids) for s in scored):,} ({len(order) - args.fit_conversations})")
    print(f"{'vocabulary':>10}  {'share of the scored replies held':>32}")
    print(f"{len(head_ids):>10}  {vocab_of(head_ids, scored).coverage:>32.4f}  (the head's own)")
    for size in args.sizes:
        grown = grown_vocab(head_ids, fit, size, vocab_size)
        print(f"{size:>10}  {vocab_of(grown.draft_to_target, scored).coverage:>32.4f}")


if __name__ == "__main__":
    main()
