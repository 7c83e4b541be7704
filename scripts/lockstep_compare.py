"""Engine configurations on one serving workload, stepped in lockstep in one process.

A server benchmark runs one configuration at a time, and on a shared 2-core VM the
machine's speed drifts by 10% or more within a minute: single rounds of two identical
servers have differed by that much, which hides gaps of a few percent. Here every engine
lives in one process and runs its own closed loop over the same requests (bench_serving's
ShareGPT sampling: held-out prompts at their real lengths, fixed-length replies, N kept in
flight, the next admitted as one finishes). The engines take turns one step at a time (A B,
then B A), so a drift slows all alike, and each is charged the time of its own steps.

A second plain engine runs beside the first as the control: its ratio to the first is the
floor below which a difference means nothing (memory placement and the like).

    python scripts/lockstep_compare.py --concurrencies 16 --num-prompts 48
    python scripts/lockstep_compare.py --config "adaptive=--speculative-algorithm EAGLE3" \
        --config "static=--speculative-algorithm EAGLE3 --disable-speculative-adaptive"
"""

from __future__ import annotations

import argparse
import collections
import shlex
import time
from dataclasses import dataclass

from eaglesrv.bench.compare.configs import BASELINE, custom
from eaglesrv.bench.serving.dataset import sample_sharegpt_requests
from eaglesrv.configs.cli import parse_engine_config
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

CONTROL = "plain (control)"


@dataclass
class ClosedLoop:
    """One engine's run over the workload: `concurrency` requests in flight until all finish."""

    engine: Engine
    prompts: collections.deque
    params: SamplingParams
    concurrency: int
    in_flight: int = 0
    seconds: float = 0.0  # summed over this engine's steps only
    output_tokens: int = 0

    @property
    def done(self) -> bool:
        return not self.prompts and not self.in_flight

    def step(self) -> None:
        while self.prompts and self.in_flight < self.concurrency:
            self.engine.add_request(self.prompts.popleft(), self.params)
            self.in_flight += 1
        started = time.perf_counter()
        outputs = self.engine.step()
        self.seconds += time.perf_counter() - started
        for out in outputs:
            self.output_tokens += len(out.new_token_ids)
            self.in_flight -= int(out.finished)


def run_lockstep(engines: dict[str, Engine], prompts: list[str], params: SamplingParams,
                 concurrency: int) -> dict[str, ClosedLoop]:
    for engine in engines.values():
        engine.flush_cache()  # every run starts cold: no run finds the prompts of the one before cached
    loops = {name: ClosedLoop(engine, collections.deque(prompts), params, concurrency)
             for name, engine in engines.items()}
    order, turn = list(loops), 0
    while not all(loop.done for loop in loops.values()):
        for name in order if turn % 2 == 0 else reversed(order):
            if not loops[name].done:
                loops[name].step()
        turn += 1
    return loops


def _cache_hits(engines: dict[str, Engine]) -> str:
    """Prompt tokens found in each engine's prefix cache so far, where it has one."""
    hits = [f"{name} {engine.scheduler.cache.hit_rate:.1%}" for name, engine in engines.items()
            if engine.scheduler.cache is not None]
    return f" (prefix cache hits: {', '.join(hits)})" if hits else ""


SPEC_COUNTERS = ("spec_steps_plain", "spec_steps_speculative", "spec_verifications", "spec_accepted_tokens")


def spec_counters(engine: Engine) -> collections.Counter:
    stats = engine.spec_stats or {}
    return collections.Counter({key: stats[key] for key in SPEC_COUNTERS if key in stats})


def speculation_summary(counts: collections.Counter) -> str:
    """What the engine did over the counted runs (the counters' growth: the policy keeps what it learnt)."""
    parts = []
    if counts["spec_steps_plain"] or counts["spec_steps_speculative"]:
        parts.append(f"steps plain {counts['spec_steps_plain']}, speculative {counts['spec_steps_speculative']}")
    if counts["spec_verifications"]:
        parts.append(f"accept length {counts['spec_accepted_tokens'] / counts['spec_verifications']:.2f}")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                        help='an engine beside plain, e.g. "adaptive=--speculative-algorithm EAGLE3" (the default)')
    parser.add_argument("--engine-args", default="--num-threads 2 --max-total-tokens 90000",
                        help="flags every engine gets (python -m eaglesrv.launch's engine flags)")
    parser.add_argument("--concurrencies", default="1,4,16,64")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128, help="tokens per reply (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=1, help="lockstep runs per concurrency, pooled")
    parser.add_argument("--no-control", action="store_true", help="leave out the second plain engine")
    args = parser.parse_args()

    configs: dict[str, tuple[str, ...]] = {BASELINE: ()}
    if not args.no_control:
        configs[CONTROL] = ()
    for item in args.config or ["adaptive=--speculative-algorithm EAGLE3"]:
        try:
            variant = custom(item)  # bench_compare's NAME=FLAGS, checked the same way
        except ValueError as exc:
            parser.error(str(exc))
        if variant.name in configs:
            parser.error(f"--config {variant.name}: that name is taken")
        configs[variant.name] = variant.server_args
    engines = {name: Engine(parse_engine_config(shlex.split(args.engine_args) + list(flags)))
               for name, flags in configs.items()}
    for engine in engines.values():
        engine.warmup()
    rows = sample_sharegpt_requests(engines[BASELINE].tokenizer, args.num_prompts, fixed_output_len=args.output_len)
    prompts = [row.prompt for row in rows]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{len(prompts)} held-out ShareGPT prompts ({sum(r.prompt_len for r in rows)} tokens), "
          f"{args.output_len}-token replies, engines: {', '.join(configs)}; engine flags: {args.engine_args}")

    for concurrency in (int(c) for c in args.concurrencies.split(",")):
        seconds, tokens = collections.Counter(), collections.Counter()
        before = {name: spec_counters(engine) for name, engine in engines.items()}
        for repeat in range(args.repeats):
            loops = run_lockstep(engines, prompts, params, concurrency)
            for name, loop in loops.items():
                seconds[name] += loop.seconds
                tokens[name] += loop.output_tokens
            print(f"  concurrency {concurrency}, run {repeat + 1}: " + ", ".join(
                f"{name} {loop.seconds:.1f} s" for name, loop in loops.items()) + _cache_hits(engines), flush=True)
        base = tokens[BASELINE] / seconds[BASELINE]
        print(f"concurrency {concurrency}:")
        for name, engine in engines.items():
            rate = tokens[name] / seconds[name]
            counts = spec_counters(engine)
            counts.subtract(before[name])
            summary = speculation_summary(counts)
            print(f"  {name:16s} {rate:7.1f} output tok/s of engine time  {rate / base:.3f}x plain"
                  + (f"  ({summary})" if summary else ""))


if __name__ == "__main__":
    main()
