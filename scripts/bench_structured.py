"""Structured output speed, side by side in one run: plain decoding and EAGLE-3 (static
tree, adaptive), each with and without the JSON-schema grammar, on the default model.

Prompts ask for a JSON document for each bounded schema of tests/data/json_schemas/.
Greedy; one request at a time (the first --sequential schemas: low load, where
speculation pays) and all schemas at once (a batch). Prints output tokens per second,
EAGLE-3's mean accept length, and the time grammar masks took (GrammarMatchers, timed).

    python scripts/bench_structured.py [--sequential 12] [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from eaglesrv.engine.grammar_masks import GrammarMatchers
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.grammar import json_schema_grammar
from eaglesrv.sampling_params import SamplingParams

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schemas"
MODES = {
    "plain": SpeculativeConfig(),
    "EAGLE-3 static 4x2x6": SpeculativeConfig(algorithm="EAGLE3", num_steps=4, eagle_topk=2, num_draft_tokens=6,
                                              adaptive=False),
    "EAGLE-3 adaptive": SpeculativeConfig(algorithm="EAGLE3"),
}


def corpus() -> list[dict]:
    entries = [json.loads(path.read_text()) for path in sorted(CORPUS.glob("*.json"))]
    return [e for e in entries if e.get("bounded") and e.get("refused") is None]


def timed_masks() -> dict[str, float]:
    """Wrap GrammarMatchers' three mask methods to add up their time."""
    spent = {"s": 0.0}
    for name in ("allowed_now", "tree_masks", "path_masks"):
        original = getattr(GrammarMatchers, name)

        def wrapper(self, *args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - started

        setattr(GrammarMatchers, name, wrapper)
    return spent


def run(engine: Engine, prompts, params, one_at_a_time: bool) -> tuple[float, int]:
    started = time.perf_counter()
    if one_at_a_time:
        results = [engine.generate([p], q)[0] for p, q in zip(prompts, params)]
    else:
        results = engine.generate(prompts, params)
    return time.perf_counter() - started, sum(len(r.output_token_ids) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", type=int, default=12, help="schemas run one at a time")
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    mask_time = timed_masks()
    entries = corpus()
    base = EngineConfig(model=ModelConfig(), cache=CacheConfig(max_total_tokens=65536))
    print("| mode | grammar | load | output tok/s | accept length | mask time share |")
    print("|---|---|---|---:|---:|---:|")
    for mode, spec in MODES.items():
        engine = Engine(dataclasses.replace(base, speculative=spec))
        tokenizer = engine.tokenizer
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a JSON document describing {e['description']}."}],
            add_generation_prompt=True, tokenize=False), add_special_tokens=False) for e in entries]
        grammars = [json_schema_grammar(e["schema"]) for e in entries]
        for constrained in (False, True):
            for load, count in (("1 at a time", args.sequential), (f"{len(entries)} at once", len(entries))):
                params = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                         grammar=grammars[i] if constrained else None) for i in range(count)]
                before = dict(engine.spec_stats or {})
                mask_time["s"] = 0.0
                seconds, tokens = run(engine, prompts[:count], params, load.startswith("1 "))
                accept = _accept_length(before, engine.spec_stats or {})
                print(f"| {mode} | {'JSON schema' if constrained else 'none'} | {load} | {tokens / seconds:.1f} | "
                      f"{accept} | {mask_time['s'] / seconds:.1%} |", flush=True)


def _accept_length(before: dict, after: dict) -> str:
    verifications = after.get("spec_verifications", 0) - before.get("spec_verifications", 0)
    if not verifications:
        return "-"
    accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    return f"{accepted / verifications:.2f}"


if __name__ == "__main__":
    main()
