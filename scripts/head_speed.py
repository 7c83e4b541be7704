"""Batch-1 greedy decode speed of several EAGLE-3 heads side by side, against plain decoding.

eval_acceptance --speed-prompts times one head's trees. Comparing heads across two such runs
mixes in the machine's drift; this runs every (head, tree) engine and a plain one in one
process, each prompt through all of them, the order reversed every other prompt. A head whose
draft vocabulary is larger accepts more but pays for a larger lm_head in every draft pass:
this shows which wins on the machine at hand.

    python scripts/head_speed.py --heads stage8=HEAD8 stage10=eaglesrv/heads/smollm2-135m-eagle3 \
        --trees 3,1,4 2,4,8 --prompts 12
"""

from __future__ import annotations

import argparse

from eaglesrv.eval_acceptance import build_engine, decode_side_by_side, heldout_prompts, parse_tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", nargs="+", required=True, metavar="NAME=PATH")
    p.add_argument("--trees", type=parse_tree, nargs="+", default=[(3, 1, 4)])
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts, each decoded by every engine")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    heads = dict(item.split("=", 1) for item in args.heads)
    settings = dict(model_path=None, dtype=args.dtype, batch_size=1, max_input_len=1024,
                    max_tokens=args.max_tokens, device="auto", num_threads=args.num_threads)

    engines = {("plain", None): build_engine(argparse.Namespace(draft_model_path=None, **settings), None)}
    for name, path in heads.items():
        for tree in args.trees:
            engines[(name, tree)] = build_engine(argparse.Namespace(draft_model_path=path, **settings), tree)
    prompts = heldout_prompts(engines[("plain", None)].tokenizer, args.prompts, settings["max_input_len"])
    totals = decode_side_by_side(engines, prompts, args.max_tokens)

    plain_rate = totals[("plain", None)][0] / totals[("plain", None)][1]
    print(f"{'head':>12} {'tree':>10} {'tok/s':>7} {'vs plain':>9} {'accept length':>14}")
    for (name, tree), (tokens, seconds) in totals.items():
        accept = f"{engines[(name, tree)].spec_stats['avg_spec_accept_length']:.3f}" if tree else "-"
        print(f"{name:>12} {str(tree or '-'):>10} {tokens / seconds:7.1f} "
              f"{tokens / seconds / plain_rate:8.3f}x {accept:>14}")


if __name__ == "__main__":
    main()
