"""Offline benchmark: eaglesrv against Hugging Face transformers, side by side in one run.

    python -m eaglesrv.bench_offline [--dtypes float32,bfloat16] [--output-json out.json]

For each dtype, on the same weights and machine:
  1. batch-1 decode rate (prefill excluded) of eaglesrv and of transformers `generate`,
     greedy with EOS ignored so both produce exactly --decode-tokens tokens; both warmed
     up, then interleaved --repeats times (the machine is noisy) and the median kept;
  2. eaglesrv continuous batching on held-out ShareGPT prompts with --concurrency requests
     in flight, as output tok/s and as a multiple of transformers' batch-1 rate;
  3. scoring the same prompts as an evaluation harness's loglikelihood requests do (every
     prompt token's logprob and whether it was the best, one output token), as prompt tok/s
     and requests/s, against transformers scoring them one at a time.
Speed is reported, never asserted (docs/architecture.md, "Rules the code relies on").
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from typing import Any, Sequence

import torch

from eaglesrv.bench.machine import machine_info
from eaglesrv.bench.offline.report import markdown_table
from eaglesrv.bench.offline.timing import (
    load_transformers_model,
    summarize,
    time_eaglesrv,
    time_transformers,
    time_transformers_scoring,
)
from eaglesrv.bench.offline.workload import BenchRequest, chat_prompt_ids, run_continuous, sharegpt_workload
from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from eaglesrv.engine.llm_engine import Engine

DECODE_PROMPT = "Write a short story about a robot who learns to paint."
WARMUP_TOKENS = 4
PAGE_SIZE = 16

# Flags whose default depends on --smoke; parsed as None and filled in from one of these.
DEFAULTS = dict(dtypes="float32,bfloat16", decode_tokens=128, repeats=3, num_prompts=64,
                concurrency=32, max_output_len=256)
SMOKE = dict(dtypes="float32", decode_tokens=8, repeats=1, num_prompts=4, concurrency=2, max_output_len=16)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.bench_offline", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="model to run (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtypes", default=None, help=f"comma-separated dtypes (default {DEFAULTS['dtypes']})")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per batch-1 decode run (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved batch-1 repeats; median kept (default 3)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="ShareGPT prompts for continuous batching (default 64)")
    p.add_argument("--concurrency", type=int, default=None, help="requests kept in flight (default 32)")
    p.add_argument("--max-output-len", type=int, default=None, help="clip ShareGPT output lengths (default 256)")
    p.add_argument("--max-input-len", type=int, default=1024, help="skip ShareGPT prompts longer than this")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--attention-backend", default="auto",
                   help="eaglesrv attention backend (default auto: the CPU kernel)")
    p.add_argument("--output-json", default=None, help="write every figure to this JSON file")
    p.add_argument("--skip-transformers", action="store_true", help="measure eaglesrv only")
    p.add_argument("--smoke", action="store_true",
                   help="tiny fast run for CI: " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the decode rate is timed from the first token)")
    if min(args.repeats, args.num_prompts, args.concurrency, args.max_output_len) < 1:
        p.error("--repeats, --num-prompts, --concurrency and --max-output-len must be at least 1")
    return args


def _log(message: str) -> None:
    print(f"[bench_offline {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_engine(args: argparse.Namespace, dtype: str) -> Engine:
    # Room for every in-flight request at its longest, plus a partly filled page each.
    max_tokens = args.concurrency * (args.max_input_len + args.max_output_len + PAGE_SIZE)
    max_tokens = max(max_tokens, 4096 + args.decode_tokens)
    return Engine(EngineConfig(
        model=ModelConfig(model_path=args.model_path, dtype=dtype),
        cache=CacheConfig(page_size=PAGE_SIZE, max_total_tokens=max_tokens),
        scheduler=SchedulerConfig(max_running_requests=args.concurrency),
        runtime=RuntimeConfig(device="cpu", num_threads=args.threads, attention_backend=args.attention_backend),
    ))


def bench_decode(args: argparse.Namespace, engine: Engine, hf_model, prompt_ids: list[int]) -> dict[str, Any]:
    """Warm both up, then alternate which goes first on each repeat, so drift hits both."""
    time_eaglesrv(engine, prompt_ids, WARMUP_TOKENS)
    if hf_model is not None:
        time_transformers(hf_model, prompt_ids, WARMUP_TOKENS)
    ours, theirs = [], []
    for repeat in range(args.repeats):
        order = ["ours", "theirs"] if repeat % 2 == 0 else ["theirs", "ours"]
        for who in order:
            if who == "ours":
                ours.append(time_eaglesrv(engine, prompt_ids, args.decode_tokens))
            elif hf_model is not None:
                theirs.append(time_transformers(hf_model, prompt_ids, args.decode_tokens))
        _log(f"  repeat {repeat + 1}: eaglesrv {ours[-1].decode_tok_s:.1f} tok/s"
             + (f", transformers {theirs[-1].decode_tok_s:.1f} tok/s" if theirs else ""))
    result: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "eaglesrv": summarize(ours).to_json()}
    if theirs:
        result["transformers"] = summarize(theirs).to_json()
        # Same weights, greedy: the tokens should agree (exactly in fp32; bf16 may drift).
        result["greedy_match"] = ours[0].token_ids == theirs[0].token_ids
        result["ratio"] = result["eaglesrv"]["decode_tok_s"] / result["transformers"]["decode_tok_s"]
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": {**{k: v for k, v in vars(args).items() if k != "output_json"},
                   "model": args.model_path or "SmolLM2-135M-Instruct (default GGUF)"},
        "decode": {}, "batch": {}, "scoring": {},
    }
    workload = None
    for dtype in args.dtypes:
        _log(f"{dtype}: loading eaglesrv" + ("" if args.skip_transformers else " and transformers"))
        engine = build_engine(args, dtype)
        hf_model = None if args.skip_transformers else load_transformers_model(args.model_path, dtype)
        prompt_ids = chat_prompt_ids(engine.tokenizer, DECODE_PROMPT)
        _log(f"{dtype}: batch-1 decode, {args.decode_tokens} tokens x {args.repeats}")
        decode = results["decode"][dtype] = bench_decode(args, engine, hf_model, prompt_ids)
        if workload is None:  # same tokenizer for every dtype: build the workload once
            workload = sharegpt_workload(engine.tokenizer, args.num_prompts, args.max_input_len, args.max_output_len)
        scoring = [BenchRequest(request.prompt_ids, 1) for request in workload]
        hf_scoring_s = None
        if hf_model is not None:
            hf_scoring_s = time_transformers_scoring(hf_model, [request.prompt_ids for request in scoring])
        del hf_model  # free its memory before the batch run needs the KV pool's
        gc.collect()

        _log(f"{dtype}: scoring {len(scoring)} prompts, {args.concurrency} in flight")
        results["scoring"][dtype] = {
            **run_continuous(engine, scoring, args.concurrency, prompt_logprobs=1).to_json(),
            "transformers_batch1_s": hf_scoring_s,
        }
        _log(f"{dtype}: continuous batching, {len(workload)} prompts, {args.concurrency} in flight")
        batch = run_continuous(engine, workload, args.concurrency).to_json()
        hf_rate = decode.get("transformers", {}).get("decode_tok_s")
        batch["transformers_batch1_tok_s"] = hf_rate
        batch["ratio_to_transformers_batch1"] = batch["output_tok_s"] / hf_rate if hf_rate else None
        batch["meets_8x_bar"] = batch["ratio_to_transformers_batch1"] >= 8 if hf_rate else None
        batch["ratio_to_eaglesrv_batch1"] = batch["output_tok_s"] / decode["eaglesrv"]["decode_tok_s"]
        results["batch"][dtype] = batch
        _log(f"{dtype}: {batch['output_tok_s']:.1f} output tok/s in {batch['total_s']:.1f} s")
        del engine
        gc.collect()
    results["machine"]["load_average_1m_end"] = machine_info()["load_average_1m"]
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    results = run(args)
    print(markdown_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
