"""GPU benchmark: the figures issue 40 sets targets for, side by side in one run.

    python -m eaglesrv.bench_gpu [--output-json out.json]          # Llama-3.1-8B shape, bf16, on CUDA
    python -m eaglesrv.bench_gpu --smoke --device cpu               # the tiny shape on the CPU, seconds
    python -m eaglesrv.bench_gpu --table out.json [--checks parts]  # print the table of an earlier run

With --load-format dummy weights (a model directory holding only config.json; the shapes
ship in eaglesrv/configs/shapes), through the in-process Engine:
  1. batch-1 plain decode, output tok/s after a warm-up (prefill excluded: timed from the
     first token to the last), as a share of the weight-streaming floor (weight bytes over
     the GPU's memory bandwidth, measure.BANDWIDTHS), with CUDA graphs and without;
  2. --concurrency requests of --input-len random token ids and --output-len output tokens
     (EOS ignored), all in flight: output tok/s, prefill included;
  3. EAGLE-3 (--spec-steps, --spec-topk, --spec-nodes) at batch 1 with a random head (of
     the published heads' 32,000-token draft vocabulary, --draft-vocab-size), every step
     verifying the full tree (adaptive off): one draft-and-verify round's time as a
     multiple of one plain decode step (both with graphs, median of --spec-rounds);
  4. SGLang's generated-shared-prefix workload in random token ids (--gsp-* flags, as in
     bench_serving), --gsp-concurrency in flight, with the prefix cache off and on (issue
     42): mean time to first token and output tok/s of each, each after a warm-up round on
     other prompts (whose cached pages are flushed before the timed run).
Each part that fails records its error and the others still run; the exit status is 1 if
any failed. The JSON is rewritten after every part, so a crash keeps what came before.
Speed is reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eaglesrv.bench.gpu.measure import (
    PUBLISHED_DRAFT_VOCAB,
    device_name,
    fixed_requests,
    random_prompts,
    shared_prefix_requests,
    streaming_floor,
    synchronize,
    time_steps,
    write_random_head,
)
from eaglesrv.bench.gpu.report import markdown_table, read_checks
from eaglesrv.bench.offline.timing import summarize, time_eaglesrv
from eaglesrv.bench.offline.workload import run_continuous
from eaglesrv.configs import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from eaglesrv.configs.shapes import shape_names, shape_path
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.model.arch import ModelArch

PAGE_SIZE = 16
# plain: decode with graphs and the batch run; eager: decode without graphs; prefix: the shared-prefix workload
PARTS = ("plain", "eager", "eagle", "prefix")

# Flags whose default depends on --smoke; parsed as None and filled in from one of these.
DEFAULTS = dict(shape="llama-3.1-8b", dtype="bfloat16", decode_tokens=128, repeats=3, prompt_len=128,
                concurrency=128, input_len=256, output_len=256, spec_rounds=32, spec_warmup=4,
                attention_backend="auto", draft_vocab_size=PUBLISHED_DRAFT_VOCAB, gsp_num_groups=4,
                gsp_prompts_per_group=16, gsp_system_prompt_len=2048, gsp_question_len=128, gsp_output_len=64,
                gsp_concurrency=16)
SMOKE = dict(shape="tiny-llama", dtype="float32", decode_tokens=8, repeats=1, prompt_len=8,
             concurrency=4, input_len=16, output_len=8, spec_rounds=4, spec_warmup=1, attention_backend="torch",
             draft_vocab_size=128, gsp_num_groups=2, gsp_prompts_per_group=4, gsp_system_prompt_len=48,
             gsp_question_len=8, gsp_output_len=4, gsp_concurrency=4)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.bench_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=None, choices=shape_names(),
                   help=f"a shipped model shape (default {DEFAULTS['shape']}; {SMOKE['shape']} with --smoke)")
    p.add_argument("--model-path", default=None,
                   help="a model directory or hub id instead of --shape (its weights are not read)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --smoke)")
    p.add_argument("--attention-backend", default=None, help="default auto (torch with --smoke)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per batch-1 decode run (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="batch-1 decode runs; median kept (default 3)")
    p.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens at batch 1 (default 128)")
    p.add_argument("--concurrency", type=int, default=None, help="concurrent requests (default 128)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens per concurrent request (default 256)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per concurrent request (default 256)")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--spec-steps", type=int, default=5)
    p.add_argument("--spec-topk", type=int, default=8)
    p.add_argument("--spec-nodes", type=int, default=32)
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the random head's draft vocabulary, written out as a head (default 32,000, as the "
                        "published Llama-3.1-8B heads; 128 with --smoke); 0, or the target's vocabulary or more: "
                        "the builder's own random head, over the whole vocabulary")
    p.add_argument("--spec-rounds", type=int, default=None, help="timed EAGLE-3 rounds and plain steps (default 32)")
    p.add_argument("--spec-warmup", type=int, default=None, help="untimed steps before them (default 4)")
    gsp = p.add_argument_group("part 4, the shared-prefix workload (SGLang's bench_serving flags)")
    gsp.add_argument("--gsp-num-groups", type=int, default=None, help="system prompts (default 4)")
    gsp.add_argument("--gsp-prompts-per-group", type=int, default=None, help="requests per system prompt (default 16)")
    gsp.add_argument("--gsp-system-prompt-len", type=int, default=None, help="default 2048")
    gsp.add_argument("--gsp-question-len", type=int, default=None, help="default 128")
    gsp.add_argument("--gsp-output-len", type=int, default=None, help="default 64")
    gsp.add_argument("--gsp-concurrency", type=int, default=None, help="requests in flight (default 16)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--output-json", default=None, help="write every figure to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny fast run for CI: " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))
    p.add_argument("--table", default=None, metavar="JSON",
                   help="print the table of an earlier run's JSON; runs nothing")
    p.add_argument("--checks", default=None, metavar="TSV",
                   help="with --table: gpu_check.sh's parts file, shown above the figures")
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown --parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the decode rate is timed from the first token)")
    if min(args.repeats, args.prompt_len, args.concurrency, args.input_len, args.output_len, args.spec_rounds) < 1:
        p.error("--repeats, --prompt-len, --concurrency, --input-len, --output-len and --spec-rounds must be >= 1")
    if min(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len, args.gsp_question_len,
           args.gsp_output_len, args.gsp_concurrency) < 1:
        p.error("every --gsp-* flag must be at least 1")
    return args


def _log(message: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Bench:
    """One run: the engines it builds one after another, and the figures so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.gsp_len = args.gsp_system_prompt_len + args.gsp_question_len  # a shared-prefix request's prompt
        self.device = torch.device(args.device if args.device != "auto" else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, args.dtype)
        self.model_path = args.model_path or str(shape_path(args.shape))
        hf_config = self._hf_config()
        self.arch = ModelArch.from_hf_config(hf_config)
        self.vocab_size = self.arch.vocab_size
        # Long enough for every request here; short keeps the graphs' block tables small.
        needed = max(args.prompt_len + (args.spec_warmup + args.spec_rounds + 2) * (args.spec_steps + 1) + 64,
                     args.prompt_len + args.decode_tokens + 64, args.input_len + args.output_len + 64,
                     self.gsp_len + args.gsp_output_len + 64)
        self.context_length = min(max(needed, 2048), self.arch.max_position_embeddings)
        self.started = time.monotonic()
        self.failed = False
        self.results: dict[str, Any] = {
            "config": {**{k: v for k, v in vars(args).items() if k not in ("output_json", "table", "checks")},
                       "shape": args.model_path or args.shape, "context_length": self.context_length},
            "device": {"type": self.device.type, "name": device_name(self.device), "torch": torch.__version__},
        }

    def _hf_config(self) -> dict[str, Any]:
        from eaglesrv.engine.loader import resolve_model

        return resolve_model(self.model_path, "dummy").hf_config

    # ---- engines --------------------------------------------------------------------
    def engine(self, graphs: bool, speculative: bool, max_running: int, max_tokens: int,
               draft_path: str | None = None, prefix_cache: bool = True) -> Engine:
        args, on_cpu = self.args, self.device.type == "cpu"
        chunk = {} if args.chunked_prefill_size is None else {"chunked_prefill_size": args.chunked_prefill_size}
        scheduler = SchedulerConfig(max_running_requests=max_running, **chunk)
        spec = SpeculativeConfig()
        if speculative:
            spec = SpeculativeConfig(algorithm="EAGLE3", draft_model_path=draft_path, num_steps=args.spec_steps,
                                     eagle_topk=args.spec_topk, num_draft_tokens=args.spec_nodes, adaptive=False)
        started = time.monotonic()
        engine = Engine(EngineConfig(
            model=ModelConfig(model_path=self.model_path, load_format="dummy", dtype=args.dtype,
                              context_length=self.context_length, skip_tokenizer_init=True),
            cache=CacheConfig(page_size=PAGE_SIZE, max_total_tokens=max_tokens + 4 * PAGE_SIZE * max_running,
                              disable_radix_cache=not prefix_cache),
            scheduler=scheduler, speculative=spec,
            # On the CPU (smoke runs) "graphs" are the stand-in with CUDA-graph semantics.
            runtime=RuntimeConfig(device=self.device.type, attention_backend=args.attention_backend,
                                  cuda_graph_max_bs=max_running, disable_cuda_graph=not graphs,
                                  graphs_on_cpu=graphs and on_cpu),
        ))
        engine.warmup()
        synchronize(self.device)
        self.results["device"]["attention"] = engine.runner.attention.name
        _log(f"engine ready in {time.monotonic() - started:.1f} s: graphs {'on' if graphs else 'off'}, "
             f"{'EAGLE-3' if speculative else 'plain'}, prefix cache {'on' if prefix_cache else 'off'}, "
             f"attention {engine.runner.attention.name}")
        return engine

    @staticmethod
    def release_memory() -> None:
        """After the caller dropped its engine: free its weights, pools and graphs before the next."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def record(self, key: str, measure: Callable[[], dict[str, Any]]) -> None:
        """Run one measurement; an error is recorded in its place and the run goes on."""
        started = time.monotonic()
        try:
            self.results[key] = measure()
        except Exception as exc:  # noqa: BLE001 - the other parts must still run
            traceback.print_exc()
            self.results[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            self.failed = True
        self.results[key]["seconds"] = round(time.monotonic() - started, 2)
        _log(f"{key}: {json.dumps(self.results[key])}")
        self.save()

    def save(self) -> None:
        self.results["elapsed_s"] = time.monotonic() - self.started
        if self.args.output_json:
            Path(self.args.output_json).write_text(json.dumps(self.results, indent=2))

    # ---- measurements ---------------------------------------------------------------
    def decode(self, engine: Engine) -> dict[str, Any]:
        args = self.args
        [prompt] = random_prompts(self.vocab_size, 1, args.prompt_len, seed=1)
        time_eaglesrv(engine, prompt, min(8, args.decode_tokens))  # warm-up
        runs = [time_eaglesrv(engine, prompt, args.decode_tokens) for _ in range(args.repeats)]
        summary = summarize(runs)
        return {"tok_s": summary.decode_tok_s, "runs_tok_s": summary.runs_tok_s, "ttft_ms": summary.ttft_ms}

    def batch(self, engine: Engine) -> dict[str, Any]:
        args = self.args
        warm = fixed_requests(self.vocab_size, args.concurrency, args.input_len, min(4, args.output_len), seed=2)
        run_continuous(engine, warm, args.concurrency)  # every prefill and decode shape once
        requests = fixed_requests(self.vocab_size, args.concurrency, args.input_len, args.output_len, seed=3)
        synchronize(self.device)
        return run_continuous(engine, requests, args.concurrency).to_json()

    def plain_step_ms(self, engine: Engine) -> float:
        args = self.args
        [prompt] = random_prompts(self.vocab_size, 1, args.prompt_len, seed=4)
        return time_steps(engine, prompt, args.spec_warmup, args.spec_rounds).median_ms

    def eagle(self, plain_step_ms: float | None) -> dict[str, Any]:
        args = self.args
        if plain_step_ms is None:
            raise RuntimeError("no plain decode step time to compare with (the plain part failed or did not run)")
        draft_vocab = args.draft_vocab_size if 0 < args.draft_vocab_size < self.vocab_size else self.vocab_size
        with tempfile.TemporaryDirectory(prefix="bench_gpu_head") as head_dir:
            draft_path = None  # the builder's random head, over the whole vocabulary
            if draft_vocab < self.vocab_size:
                started = time.monotonic()
                draft_path = str(write_random_head(self.arch, draft_vocab, Path(head_dir)))
                _log(f"random head with a {draft_vocab}-token draft vocabulary written in "
                     f"{time.monotonic() - started:.1f} s")
            engine = self.engine(graphs=True, speculative=True, max_running=1,
                                 max_tokens=self.context_length + PAGE_SIZE, draft_path=draft_path)
        try:
            [prompt] = random_prompts(self.vocab_size, 1, args.prompt_len, seed=4)
            timing = time_steps(engine, prompt, args.spec_warmup, args.spec_rounds, args.spec_steps + 1)
        finally:
            del engine
            self.release_memory()
        return {"round_ms": timing.median_ms, "plain_step_ms": plain_step_ms,
                "ratio": timing.median_ms / plain_step_ms, "tokens_per_round": statistics.fmean(timing.tokens),
                "rounds": len(timing.step_ms), "draft_vocab_size": draft_vocab}

    def shared_prefix(self) -> dict[str, Any]:
        """The shared-prefix workload with the prefix cache off, then on, in engines built alike."""
        args = self.args

        def workload(seed: int) -> list:
            return shared_prefix_requests(self.vocab_size, args.gsp_num_groups, args.gsp_prompts_per_group,
                                          args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                          seed)

        # Room for every system prompt cached beside the requests in flight: nothing is evicted.
        pool = (args.gsp_num_groups * args.gsp_system_prompt_len
                + args.gsp_concurrency * (self.gsp_len + args.gsp_output_len + PAGE_SIZE))
        runs = {}
        for cache_on in (False, True):
            engine = self.engine(graphs=True, speculative=False, max_running=args.gsp_concurrency,
                                 max_tokens=pool, prefix_cache=cache_on)
            try:
                # Warm-up on other prompts: one full round of requests, then their pages are dropped.
                run_continuous(engine, workload(seed=5)[: args.gsp_concurrency], args.gsp_concurrency)
                engine.flush_cache()
                cache = engine.scheduler.cache
                hits_before = cache.hit_tokens if cache is not None else 0
                synchronize(self.device)
                result = run_continuous(engine, workload(seed=6), args.gsp_concurrency).to_json()
                result["cached_prompt_tokens"] = cache.hit_tokens - hits_before if cache is not None else 0
                runs["cache_on" if cache_on else "cache_off"] = result
            finally:
                del engine
                self.release_memory()
        off, on = runs["cache_off"], runs["cache_on"]
        return {**runs, "ttft_ratio": off["mean_ttft_ms"] / on["mean_ttft_ms"],
                "tok_s_ratio": on["output_tok_s"] / off["output_tok_s"]}

    def run(self) -> dict[str, Any]:
        args = self.args
        _log(f"{self.results['device']['name']}: {self.results['config']['shape']}, {args.dtype}, parts {args.parts}")
        self.record("floor", lambda: streaming_floor(self.arch, self.dtype, self.device).to_json())
        plain_step: list[float] = []
        if "plain" in args.parts:
            pool = max(args.concurrency * (args.input_len + args.output_len + PAGE_SIZE), self.context_length)
            engine = None
            try:
                engine = self.engine(graphs=True, speculative=False, max_running=args.concurrency, max_tokens=pool)
                self.record("decode_graphs", lambda: self.decode(engine))

                def step() -> dict[str, Any]:
                    plain_step.append(self.plain_step_ms(engine))
                    return {"median_ms": plain_step[0]}
                self.record("plain_step", step)
                self.record("batch", lambda: self.batch(engine))
            except Exception as exc:  # noqa: BLE001 - building failed: the rows it owns say so
                traceback.print_exc()
                self.failed = True
                for key in ("decode_graphs", "batch"):
                    self.results.setdefault(key, {"error": f"engine: {type(exc).__name__}: {exc}"[:300]})
                self.save()
            finally:
                engine = None
                self.release_memory()
        if "eager" in args.parts:
            def eager() -> dict[str, Any]:
                engine = self.engine(graphs=False, speculative=False, max_running=1,
                                     max_tokens=self.context_length + PAGE_SIZE)
                try:
                    return self.decode(engine)
                finally:
                    del engine
                    self.release_memory()
            self.record("decode_eager", eager)
        if "eagle" in args.parts:
            self.record("eagle", lambda: self.eagle(plain_step[0] if plain_step else None))
        if "prefix" in args.parts:
            self.record("prefix", self.shared_prefix)
        self.save()
        return self.results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        path = Path(args.table)
        results = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else None
        print(markdown_table(results, read_checks(args.checks) if args.checks else None))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bench = Bench(args)
    results = bench.run()
    print(markdown_table(results))
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
