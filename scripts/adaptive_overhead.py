"""What the adaptive engine's plain steps cost beyond the plain engine's, measured in lockstep.

Both engines (default model, one process) hold the same N decoding requests; blocks of
steps alternate between them (A B, then B A, ...), so a machine whose speed drifts slows
both alike. Under load the adaptive engine decodes plainly, so any difference is its own
bookkeeping: the policy's decision, the feature backlog, the step correction.

    python scripts/adaptive_overhead.py --requests 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.eval_acceptance import heldout_prompts
from eaglesrv.sampling_params import SamplingParams


def build(adaptive: bool, threads: int) -> Engine:
    spec = (SpeculativeConfig(algorithm="EAGLE3", num_steps=5, eagle_topk=8, num_draft_tokens=32, adaptive=True)
            if adaptive else SpeculativeConfig())
    return Engine(EngineConfig(model=ModelConfig(model_path=None, dtype="bfloat16"),
                               cache=CacheConfig(max_total_tokens=90000), scheduler=SchedulerConfig(),
                               speculative=spec, runtime=RuntimeConfig(device="cpu", num_threads=threads)))


def timed(obj, name: str, label: str, totals: dict) -> None:
    """Wrap obj.name so that its seconds add up in totals[label]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - started

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=24, help="blocks per engine")
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()

    engines = {"plain": build(False, args.num_threads), "adaptive": build(True, args.num_threads)}
    for engine in engines.values():
        engine.warmup()
    prompts = heldout_prompts(engines["plain"].tokenizer, args.requests, 1024)
    decode_steps = args.blocks * args.steps_per_block + 60
    for engine in engines.values():
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True))
        for _ in range(40):  # every prefill done: from here on each step decodes every request
            engine.step()

    totals: dict = defaultdict(float)
    runner = engines["adaptive"].runner
    for name in ("_decide", "_extend"):
        timed(runner, name, name, totals)
    timed(runner.adaptive, "observe", "observe", totals)
    per_step = {name: [] for name in engines}
    for block in range(args.blocks):
        for name in (list(engines) if block % 2 == 0 else list(reversed(list(engines)))):
            started = time.perf_counter()
            for _ in range(args.steps_per_block):
                engines[name].step()
            per_step[name].append((time.perf_counter() - started) / args.steps_per_block)

    ratios = [a / p for a, p in zip(per_step["adaptive"], per_step["plain"])]
    steps = args.blocks * args.steps_per_block
    print(f"{args.requests} requests decoding, {steps} steps per engine in {args.blocks} alternating blocks")
    for name, times in per_step.items():
        print(f"  {name:9s} median step {1e3 * statistics.median(times):.2f} ms")
    print(f"  adaptive / plain, per block pair: median {statistics.median(ratios):.4f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    print("  adaptive bookkeeping per step: " + ", ".join(
        f"{name} {1e3 * seconds / steps:.3f} ms" for name, seconds in totals.items()))
    print(f"  adaptive steps: {runner.adaptive.steps}")


if __name__ == "__main__":
    main()
