"""Offline generation from the command line, on the in-process engine.

    python -m eaglesrv.generate --prompt "Which city is the capital of France?"

With no --model-path it runs the default model, SmolLM2-135M-Instruct (fetched once).
The prompt goes through the model's chat template unless --raw is given.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

from eaglesrv.configs.cli import add_engine_args, engine_config_from_args
from eaglesrv.configs.errors import ConfigError
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import InvalidSamplingParams, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eaglesrv.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", action="append", help="A prompt; repeat for a batch (default: a sample question).")
    parser.add_argument("--raw", action="store_true", help="Send the prompt as is, without the chat template.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
    except (ConfigError, InvalidSamplingParams) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = Engine(config)
    questions = args.prompt or ["Which city is the capital of France?"]
    prompts = [q if args.raw else _chat(engine, q) for q in questions]
    started = time.monotonic()
    results = engine.generate(prompts, params)
    elapsed = time.monotonic() - started
    for question, result in zip(questions, results):
        print(f"\n>>> {question}\n{result.text}\n"
              f"[{len(result.output_token_ids)} tokens, finish: {result.finish_reason}]")
    total = sum(len(r.output_token_ids) for r in results)
    print(f"\n{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)")
    return 0


def _chat(engine: Engine, question: str) -> str:
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        return question
    messages = [{"role": "user", "content": question}]
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


if __name__ == "__main__":
    sys.exit(main())
