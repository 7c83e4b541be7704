"""How many greedy outputs stay identical when only the batch or the speculation changes.

    python scripts/greedy_agreement.py --dtype bfloat16 --num-prompts 16

Runs the same held-out prompts (64 tokens each, EOS ignored) through plain decoding at
batch 1 and at --batch-size, and through EAGLE-3 with the shipped head at each tree, and
counts the prompts whose tokens equal those of plain decoding at --batch-size. In float32
all should agree (the tests check exactness there); in bfloat16 a token's logits depend
on how many rows share its pass, so near-ties flip and outputs depend on the batch.
"""

from __future__ import annotations

import argparse

from eaglesrv import SamplingParams
from eaglesrv.bench.offline.workload import sharegpt_workload
from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from eaglesrv.engine.llm_engine import Engine

TREES = ((3, 1, 4), (5, 8, 32))


def outputs(dtype: str, batch: int, spec: SpeculativeConfig, num_prompts: int, threads: int) -> list[list[int]]:
    engine = Engine(EngineConfig(
        model=ModelConfig(dtype=dtype), cache=CacheConfig(max_total_tokens=batch * 1200),
        scheduler=SchedulerConfig(max_running_requests=batch), speculative=spec,
        runtime=RuntimeConfig(device="cpu", num_threads=threads)))
    prompts = [r.prompt_ids for r in sharegpt_workload(engine.tokenizer, num_prompts, 1024, 64)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    return [result.output_token_ids for result in engine.generate(prompts, params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    run = lambda batch, spec: outputs(args.dtype, batch, spec, args.num_prompts, args.num_threads)  # noqa: E731
    reference = run(args.batch_size, SpeculativeConfig())
    candidates = {"plain, batch 1": run(1, SpeculativeConfig())}
    for steps, topk, tokens in TREES:
        spec = SpeculativeConfig(algorithm="EAGLE3", num_steps=steps, eagle_topk=topk, num_draft_tokens=tokens,
                                 adaptive=False)
        candidates[f"EAGLE-3 ({steps},{topk},{tokens}), batch {args.batch_size}"] = run(args.batch_size, spec)
    for name, produced in candidates.items():
        same = sum(a == b for a, b in zip(produced, reference, strict=True))
        print(f"{args.dtype}: {name}: {same}/{args.num_prompts} identical to plain at batch {args.batch_size}")


if __name__ == "__main__":
    main()
