"""Plain decoding against EAGLE-3 settings, side by side, at several loads.

Starts `python -m eaglesrv.launch` once per configuration (plain; one static EAGLE-3 server,
SGLang's behaviour, per --eagle-configs entry; one adaptive server, eaglesrv's default, per
--adaptive-configs entry; any --config
NAME=FLAGS, from another eaglesrv source tree with --config-source NAME=DIR), sends the
same ShareGPT prompts at each of --concurrencies (--rounds times each, interleaved across
the configurations), and writes to --output-dir:
  bench_compare.md    output tok/s (and the ratio to plain), accept length, TTFT, ITL
  bench_compare.json  the same runs in full, with the machine and the settings
  throughput.png      output tok/s against concurrency, one line per configuration
  runs.jsonl, logs/   every run's record (bench_serving's JSONL) and every server's log

    python -m eaglesrv.bench_compare --num-prompts 100 --concurrencies 1,4,16,64 \\
        --speculative-draft-model-path HEAD --eagle-configs 5,8,32 3,1,4 \\
        --server-args "--num-threads 2 --max-total-tokens 65536" --output-dir docs/bench_compare_cpu
    python -m eaglesrv.bench_compare --baseline radix --config "radix=" \\
        --config "no-radix=--disable-radix-cache" --dataset-name generated-shared-prefix \\
        --gsp-num-groups 8 --gsp-prompts-per-group 8 --concurrencies 4,16 --output-dir gsp_out

Any of bench_serving's workloads runs (--dataset-name), the shared-prefix and multi-turn
ones included; every run flushes the server's prefix cache first.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from eaglesrv.bench.compare.configs import BASELINE, EagleTree, ServerVariant, build_configs, with_sources
from eaglesrv.bench.compare.report import JSON_NAME, MARKDOWN_NAME, PLOT_NAME, require_matplotlib
from eaglesrv.bench.compare.run import CompareSettings, run_comparison
from eaglesrv.bench.serving.client import BACKENDS
from eaglesrv.bench.serving.dataset import summarize
from eaglesrv.bench.serving.run import Workload
from eaglesrv.bench.serving.tokenizer import load_tokenizer
from eaglesrv.bench_serving import add_dataset_args, fill_defaults, requests_from_args

SMOKE_CONCURRENCIES = "1,2"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # what the servers run without --model-path
MODEL_FLAGS = ("--model-path", "--model", "--tokenizer-path")  # given once, as bench_compare's own flags


def _concurrencies(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies are positive integers, e.g. 1,4,16,64")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eaglesrv.bench_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="the served model (default: eaglesrv's default model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or hub id, for the servers and for counting (default: the model's)")
    p.add_argument("--speculative-draft-model-path", default=None,
                   help="the EAGLE-3 head for --eagle-configs (default model: the head eaglesrv ships)")
    p.add_argument("--eagle-configs", nargs="+", type=EagleTree.parse, default=None, metavar="STEPS,TOPK,TOKENS",
                   help="one static EAGLE-3 server per setting (SGLang's --speculative-num-steps, -eagle-topk, "
                        "-num-draft-tokens; the tree at every step); default with a draft path: 5,8,32")
    p.add_argument("--adaptive-configs", nargs="+", type=EagleTree.parse, default=[], metavar="STEPS,TOPK,TOKENS",
                   help="one adaptive server per setting, the largest tree its steps may use")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help='one more configuration, e.g. --config "adaptive=--speculative-algorithm EAGLE3 ..." '
                        "(repeatable)")
    p.add_argument("--baseline", default=BASELINE, metavar="NAME",
                   help="the configuration the ratios are to (default: plain, the server with no added flags); "
                        "naming another one (a --config NAME) leaves plain out")
    p.add_argument("--config-source", action="append", default=[], metavar="NAME=DIR",
                   help="run configuration NAME's server from the eaglesrv source tree at DIR (which holds "
                        "eaglesrv/, e.g. a `git worktree add DIR REV`) instead of the installed eaglesrv, to "
                        "compare code revisions in one run (repeatable)")
    p.add_argument("--concurrencies", type=_concurrencies, default=None,
                   help=f"requests in flight, comma-separated (default 1,4,16,64; {SMOKE_CONCURRENCIES} "
                        "with --smoke)")
    p.add_argument("--server-args", default="",
                   help='flags for every server, e.g. "--num-threads 2 --max-total-tokens 65536" '
                        '(a single flag needs the = form: --server-args="--disable-cuda-graph")')
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every configuration at each concurrency, interleaved (order reversed each "
                        "round) and pooled in the table; above 1 every server stays up at once, so on a GPU "
                        "give each a share of memory (--mem-fraction-static) (default 1)")
    p.add_argument("--backend", default="sglang", choices=BACKENDS,
                   help="the API the requests use (default: sglang, the native /generate)")
    p.add_argument("--output-dir", type=Path, default=Path("bench_compare_out"))
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to load")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_dataset_args(p)
    args = p.parse_args(argv)
    if args.num_prompts is None and not args.smoke:
        args.num_prompts = 100  # bench_serving's 1000 would take hours per configuration on a CPU
    args = fill_defaults(args)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.concurrencies is None:
        args.concurrencies = _concurrencies(SMOKE_CONCURRENCIES if args.smoke else "1,4,16,64")
    if args.eagle_configs is None:
        args.eagle_configs = [EagleTree(5, 8, 32)] if args.speculative_draft_model_path else []
    return args


def model_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The model flags every server gets: the benchmark counts tokens with the same tokenizer."""
    flags = ("--model-path", args.model_path) if args.model_path else ()
    return flags + (("--tokenizer-path", args.tokenizer) if args.tokenizer else ())


def _check_server_args(server_args: Sequence[str]) -> None:
    given = [flag for flag in server_args if flag.split("=")[0] in MODEL_FLAGS]
    if given:
        raise SystemExit(f"pass {', '.join(given)} as bench_compare's --model-path / --tokenizer, not in "
                         "--server-args: the tokenizer that counts tokens must be the served model's")


def workload_source(args: argparse.Namespace, rows: Workload) -> str:
    """What the requests are, e.g. "100 held-out ShareGPT prompts (seed 1)"."""
    split = "held-out" if args.sharegpt_split == "heldout" else "any"
    if args.dataset_name == "random":
        return (f"{len(rows)} random prompts ({args.random_input_len} in, {args.random_output_len} out, "
                f"ratio {args.random_range_ratio})")
    if args.dataset_name == "generated-shared-prefix":
        return (f"{len(rows)} generated shared-prefix prompts ({args.gsp_num_groups} groups of "
                f"{args.gsp_prompts_per_group}: {args.gsp_system_prompt_len}-token system prompts, "
                f"{args.gsp_question_len}-token questions, {args.gsp_output_len} out; seed {args.seed})")
    if args.dataset_name == "sharegpt-multiturn":
        turns = sum(r.num_turns for r in rows)
        return (f"{len(rows)} {split} ShareGPT conversations of {turns} turns in all, replayed turn by turn "
                f"(seed {args.seed}; input tokens: the user turns' own)")
    return f"{len(rows)} {split} ShareGPT prompts (seed {args.seed})"


def describe(args: argparse.Namespace, rows: Workload, configs: Sequence[ServerVariant]) -> list[str]:
    """The lines above the table: what ran, on what."""
    from eaglesrv.bench.machine import machine_info

    m = machine_info()
    baseline = args.baseline
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; "
        f"1-min load average {m['load_average_1m']} at start",
        f"Model: {args.model_path or DEFAULT_MODEL}; {workload_source(args, rows)}, "
        f"{sum(r.prompt_len for r in rows)} input and {sum(r.output_len for r in rows)} output tokens, EOS ignored; "
        f"backend {args.backend}",
        "Server flags: " + "; ".join(f"{c.name}: `{shlex.join([*c.server_args, *shlex.split(args.server_args)])}`"
                                     for c in configs),
        *[_source_line(c) for c in configs if c.source_dir],
        f"vs {baseline}: output tok/s over {baseline}'s at the same concurrency. "
        "Accept length: tokens per verification.",
        *([f"{args.rounds} rounds per configuration and concurrency, interleaved, order reversed each round; "
           "rows pool the rounds (tokens over time); 'each round': the range of the per-round ratios."]
          if args.rounds > 1 else []),
    ]


def _source_line(config: ServerVariant) -> str:
    revision = source_revision(config.source_dir)
    return f"{config.name} runs eaglesrv from `{config.source_dir}`" + (f" ({revision})" if revision else "")


def request_count(rows: Workload) -> int:
    """Requests one run sends: a multi-turn conversation sends one per turn."""
    return sum(getattr(r, "num_turns", 1) for r in rows)


def smoke_problems(args: argparse.Namespace, configs: Sequence[ServerVariant], runs: list[dict],
                   expected_requests: int) -> list[str]:
    problems = []
    for config in configs:
        for c in args.concurrencies:
            for round_number in range(1, args.rounds + 1):
                where = f"{config.name} at concurrency {c}" + (f", round {round_number}" if args.rounds > 1 else "")
                run = next((r for r in runs if (r["config"], r["max_concurrency"], r["round"])
                            == (config.name, c, round_number)), None)
                if run is None or run["completed"] != expected_requests:
                    problems.append(f"{where}: " + ("no run" if run is None else f"{run['failed']} requests failed"))
                elif "--speculative-algorithm" in config.server_args and run.get("accept_length") is None:
                    problems.append(f"{where}: no accept length")
    for name in (MARKDOWN_NAME, JSON_NAME, PLOT_NAME):
        path = args.output_dir / name
        if not path.is_file() or path.stat().st_size == 0:
            problems.append(f"{path} missing")
    return problems


def run_context(args: argparse.Namespace, argv: Sequence[str] | None, configs: Sequence[ServerVariant],
                server_args: Sequence[str], header: list[str], num_rows: int) -> dict[str, Any]:
    """What the JSON records beside the runs: the command, the settings, each server's flags."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["eagle_configs"] = [str(t) for t in args.eagle_configs]
    command = ["python", "-m", "eaglesrv.bench_compare", *(argv if argv is not None else sys.argv[1:])]
    unit = "conversations" if args.dataset_name == "sharegpt-multiturn" else "prompts"
    return {
        "title": f"Output throughput, {num_rows} {unit}, {args.model_path or DEFAULT_MODEL}",
        "baseline": args.baseline,
        "command": shlex.join(command), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "header": header,
        "settings": settings,
        "configs": [{"name": c.name, "server_args": [*model_args(args), *c.server_args, *server_args],
                     **({"source_dir": str(c.source_dir), "source_revision": source_revision(c.source_dir)}
                        if c.source_dir else {})}
                    for c in configs],
    }


def source_revision(source_dir: Path | None) -> str | None:
    """`git describe` of a source tree that is a checkout or worktree of its own, else None:
    a path under /tmp says nothing a month later; a commit does."""
    if source_dir is None or not (source_dir / ".git").exists():  # not a tree of an enclosing checkout
        return None
    try:
        done = subprocess.run(["git", "-C", str(source_dir), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git here
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def build_variants(args: argparse.Namespace) -> list[ServerVariant]:
    """Every configuration to run; a bad --config, --eagle-configs or --config-source stops
    here, before any server starts."""
    try:
        configs = build_configs(args.speculative_draft_model_path, args.eagle_configs, args.config,
                                args.adaptive_configs, default_model=args.model_path is None, baseline=args.baseline)
        return with_sources(configs, args.config_source)
    except ValueError as e:
        raise SystemExit(f"bench_compare: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    require_matplotlib()
    server_args = tuple(shlex.split(args.server_args))
    _check_server_args(server_args)
    configs = build_variants(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model_path)  # None: the default model's
    rows = requests_from_args(args, tokenizer)
    print(summarize(rows))
    header = describe(args, rows, configs)
    settings = CompareSettings(
        concurrencies=args.concurrencies, output_dir=args.output_dir, backend=args.backend,
        model_args=model_args(args), server_args=server_args, startup_timeout_s=args.startup_timeout,
        seed=args.seed, show_progress=not args.disable_tqdm, rounds=args.rounds, baseline=args.baseline,
    )
    context = run_context(args, argv, configs, server_args, header, len(rows))
    runs = run_comparison(configs, rows, tokenizer, settings, context, header)
    print("\n" + (args.output_dir / MARKDOWN_NAME).read_text())
    print("Written: " + ", ".join(str(args.output_dir / name) for name in (MARKDOWN_NAME, JSON_NAME, PLOT_NAME)))
    if args.smoke:
        problems = smoke_problems(args, configs, runs, request_count(rows))
        print("Smoke check: " + ("; ".join(problems) if problems else "every configuration and concurrency ran"))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
