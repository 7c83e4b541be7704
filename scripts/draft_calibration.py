"""How well a head's draft probabilities predict greedy acceptance, by unroll step and rank.

A tree is built from the draft's cumulative log-probabilities (engine/eagle3/tree.py), so
it holds the nodes most likely to be accepted only if a child's draft probability is the
chance that greedy verification keeps it. This reads validation features (`train_eagle3
--val-conversations` caches them under --work-dir as val-features-KEY: the target's greedy
replies, their features and its top token at every position) and, at every root where
the steps before all hit, compares the draft's probability of its rank-r token with how
often that token is the target's own top token:

    python scripts/draft_calibration.py --features HEAD/work/val-features-KEY \
        --head eaglesrv/heads/smollm2-135m-eagle3 --steps 5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eaglesrv.engine.eagle3.head_io import load_draft_head
from eaglesrv.eval_acceptance import build_engine
from eaglesrv.train_eagle3.features import FeatureCache
from eaglesrv.train_eagle3.trainer import collate, plan_epoch
from eaglesrv.train_eagle3.ttt import draft_logits, shift_left, unroll

EDGES = torch.tensor([0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0 + 1e-6])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", required=True, help="a val-features-* directory")
    p.add_argument("--head", required=True)
    p.add_argument("--model-path", default=None, help="the target (default: the default model)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch-tokens", type=int, default=2048)
    args = p.parse_args()

    target = build_engine(argparse.Namespace(model_path=args.model_path, draft_model_path=None, dtype="bfloat16",
                                             batch_size=1, max_input_len=16, max_tokens=1, device="cpu",
                                             num_threads=None), None)
    embedding = target.model.model.embed_tokens.weight.detach().float()
    draft = load_draft_head(args.head, target.arch, embedding, torch.float32, torch.device("cpu"))
    cache = FeatureCache(Path(args.features))
    shape = (args.steps, args.ranks, len(EDGES) - 1)
    prob_sum, hits, count = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    lengths = [cache.length(i) for i in range(len(cache))]
    with torch.no_grad():
        for indices in plan_epoch(lengths, args.batch_tokens, seed=0, epoch=0):
            batch = collate(cache, indices, torch.device("cpu"))
            top = batch["top"]
            leading = top >= 0  # roots still on the greedy path: every earlier step hit
            for step, hidden in enumerate(unroll(draft, batch["input_ids"], batch["aux"], args.steps)):
                probs, tokens = torch.softmax(draft_logits(draft, hidden).float(), -1).topk(args.ranks, -1)
                guess = draft.draft_to_target[tokens]
                wanted = shift_left(top, 1 + step, -1)
                leading &= wanted >= 0
                for rank in range(args.ranks):
                    prob = probs[..., rank][leading]
                    hit = (guess[..., rank] == wanted)[leading].float()
                    where = torch.bucketize(prob, EDGES, right=True) - 1
                    prob_sum[step, rank].index_add_(0, where, prob)
                    hits[step, rank].index_add_(0, where, hit)
                    count[step, rank].index_add_(0, where, torch.ones_like(prob))
                leading &= guess[..., 0] == wanted

    print("draft probability -> share kept by greedy verification, per unroll step and rank")
    for step in range(args.steps):
        roots = int(count[step, 0].sum())
        print(f"step {step} ({roots} roots on the greedy path)")
        for rank in range(args.ranks):
            total = count[step, rank].sum()
            bins = " ".join(f"{prob_sum[step, rank, b] / count[step, rank, b]:.2f}->"
                            f"{hits[step, rank, b] / count[step, rank, b]:.2f}"
                            for b in range(shape[2]) if count[step, rank, b] >= 50)
            print(f"  rank {rank}: mean {prob_sum[step, rank].sum() / total:.3f} -> "
                  f"{hits[step, rank].sum() / total:.3f}   {bins}")


if __name__ == "__main__":
    main()
