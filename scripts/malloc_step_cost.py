"""Engine steps with and without eaglesrv's glibc setting (utils/malloc.py), side by side.

Each case runs in fresh processes, alternating setting on and off (A B A B ...), since the
setting is process-wide. A process holds N requests of the default model decoding, warms
up, then times steps: median step time and minor page faults per step.

    python scripts/malloc_step_cost.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {  # name: (requests, temperature, EAGLE-3 tree or None)
    "plain, 64 greedy": (64, 0.0, None),
    "plain, 64 sampled T=0.8": (64, 0.8, None),
    "plain, 128 sampled T=0.8 (self-distillation)": (128, 0.8, None),
    "EAGLE-3 (5,8,32), 1 sampled T=1": (1, 1.0, (5, 8, 32)),
}


def measure(requests: int, temperature: float, tree: list | None, steps: int, threads: int) -> dict:
    from eaglesrv.configs import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        RuntimeConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.eval_acceptance import heldout_prompts
    from eaglesrv.sampling_params import SamplingParams

    spec = (SpeculativeConfig(algorithm="EAGLE3", num_steps=tree[0], eagle_topk=tree[1], num_draft_tokens=tree[2],
                              adaptive=False)
            if tree else SpeculativeConfig())
    engine = Engine(EngineConfig(model=ModelConfig(model_path=None, dtype="bfloat16"),
                                 cache=CacheConfig(max_total_tokens=160000), scheduler=SchedulerConfig(),
                                 speculative=spec, runtime=RuntimeConfig(device="cpu", num_threads=threads)))
    engine.warmup()
    for prompt in heldout_prompts(engine.tokenizer, requests, 1024):
        engine.add_request(prompt, SamplingParams(temperature=temperature,
                                                  max_tokens=(8 if tree else 1) * (steps + 30) + 50,
                                                  ignore_eos=True, seed=0))
    for _ in range(30):  # every prefill done, the heap settled
        engine.step()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"median_ms": 1000 * statistics.median(times), "faults_per_step": faults / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="process pairs per case")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        requests, temperature, tree = CASES[args.child]
        print(json.dumps(measure(requests, temperature, tree, args.steps, args.num_threads)))
        return

    print("| case | setting | median step ms | page faults / step |\n|---|---|---:|---:|")
    for name in CASES:
        results: dict[str, list[dict]] = {"on": [], "off": []}
        for round_ in range(args.rounds):
            for setting in (("on", "off") if round_ % 2 == 0 else ("off", "on")):
                env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                env["EAGLESRV_KEEP_FREED_MEMORY"] = "1" if setting == "on" else "0"
                out = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps),
                                      "--num-threads", str(args.num_threads)],
                                     env=env, capture_output=True, text=True, check=True).stdout
                results[setting].append(json.loads(out.strip().splitlines()[-1]))
        for setting, runs in results.items():
            ms = statistics.median(r["median_ms"] for r in runs)
            faults = statistics.median(r["faults_per_step"] for r in runs)
            print(f"| {name} | {setting} | {ms:.1f} | {faults:.0f} |")
        on = statistics.median(r["median_ms"] for r in results["on"])
        off = statistics.median(r["median_ms"] for r in results["off"])
        print(f"| {name} | off / on | {off / on:.2f}x | |")


if __name__ == "__main__":
    main()
