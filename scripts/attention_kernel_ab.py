"""The CPU attention kernel against an earlier revision of itself, side by side in one process.

Two measures: the kernel alone on made-up pages (decode rows and 4-node trees, 1 to 64
sequences), and decode-only engine steps on held-out prompts (plain, and a chain if
--tree is given), every engine built twice, once per kernel, the order reversed each round.

    python scripts/attention_kernel_ab.py --baseline HEAD~1 --batch 16 --tree 3,1,4
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from eaglesrv.eval_acceptance import build_engine, heldout_prompts, parse_tree
from eaglesrv.kernels.attention import cpu_build, cpu_paged
from eaglesrv.sampling_params import SamplingParams

SOURCE = "eaglesrv/kernels/attention/csrc/paged_attention_cpu.cpp"


def build_baseline(revision: str):
    """The kernel as it was at `revision`, compiled under its own name."""
    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    source = Path(tempfile.mkdtemp()) / "baseline_paged_attention_cpu.cpp"
    source.write_text(text)
    return cpp_extension.load(name="eaglesrv_attention_baseline", sources=[str(source)],
                              extra_cflags=cpu_build.CFLAGS, extra_ldflags=cpu_build.LDFLAGS)


def kernel_alone(kernels: dict, page_size: int = 16) -> None:
    """Microseconds a layer for SmolLM2's heads (9 over 3 kv heads of 64), bf16."""
    k_cache = torch.randn(120_000, 3, 64, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    backend = cpu_paged.CpuAttentionBackend(page_size, torch.device("cpu"))  # only its planner is used
    for sequences, context in ((1, 300), (1, 1000), (16, 500), (64, 500)):
        for rows in (1, 4):
            spans = []
            for s in range(sequences):
                pages = list(range(s * 100, s * 100 + (context + rows) // page_size + 1))
                tree = torch.ones(rows, rows, dtype=torch.bool).tril()
                mask = torch.cat([torch.ones(rows, context, dtype=torch.bool), tree], 1) if rows > 1 else None
                spans.append(cpu_paged.SequenceSpan(pages, context, rows, mask))
            plan = backend.plan(spans).kernel
            q = torch.randn(sequences * rows, 9, 64, dtype=torch.bfloat16)
            times = {}
            for name, ops in list(kernels.items()) * 2:
                out = torch.empty_like(q)
                call = lambda: ops.paged_attention(q, k_cache, v_cache, out, plan.rows, plan.row_pages,  # noqa: E731
                                                   plan.row_num_keys, plan.row_mask_offset, plan.masks, page_size,
                                                   0.125)
                call()
                repeats = 200 if sequences == 1 else 20
                started = time.perf_counter()
                for _ in range(repeats):
                    call()
                times[name] = min(times.get(name, float("inf")), (time.perf_counter() - started) / repeats * 1e6)
            print(f"{sequences:3d} sequences x {rows} rows, {context:5d} keys: "
                  + "  ".join(f"{name} {us:7.1f} us" for name, us in times.items())
                  + f"  current/baseline {times['current'] / times['baseline']:.2f}")


def decode_steps(kernels: dict, args: argparse.Namespace) -> None:
    """Tokens a second over decode-only steps (every request past its prefill)."""
    settings = argparse.Namespace(draft_model_path=args.draft_model_path, model_path=None, dtype="bfloat16",
                                  batch_size=args.batch, max_input_len=1024, max_tokens=args.max_tokens,
                                  device="cpu", num_threads=args.num_threads)
    engines = {}
    for name, ops in kernels.items():
        cpu_paged.load_cpu_attention = lambda ops=ops: ops  # the backend takes its kernel from here
        for tree in [None] + ([args.tree] if args.tree else []):
            engines[(name, tree)] = build_engine(settings, tree)
    prompts = heldout_prompts(next(iter(engines.values())).tokenizer, args.batch, 1024)
    totals = {key: [0, 0.0] for key in engines}
    order = list(engines.items())
    for round_ in range(args.rounds):
        for key, engine in order if round_ % 2 == 0 else reversed(order):
            for prompt in prompts:
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
            started_requests: set[str] = set()
            while engine.has_unfinished:
                decoding = len(started_requests) == len(prompts)
                started = time.perf_counter()
                outputs = engine.step()
                if decoding:
                    totals[key][0] += sum(len(out.new_token_ids) for out in outputs)
                    totals[key][1] += time.perf_counter() - started
                started_requests.update(out.request_id for out in outputs)
    for tree in dict.fromkeys(tree for _, tree in engines):
        rate = {name: totals[(name, tree)][0] / totals[(name, tree)][1] for name in kernels}
        print(f"{str(tree or 'plain'):>10} at {args.batch}: "
              + "  ".join(f"{n} {r:6.1f} tok/s" for n, r in rate.items())
              + f"  current/baseline {rate['current'] / rate['baseline']:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD~1", help="git revision whose kernel is the baseline")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tree", type=parse_tree, default=None, help="also a chain or tree engine, e.g. 3,1,4")
    p.add_argument("--draft-model-path", default="eaglesrv/heads/smollm2-135m-eagle3", help="the head --tree uses")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    kernels = {"current": cpu_build.load_cpu_attention(), "baseline": build_baseline(args.baseline)}
    kernel_alone(kernels)
    decode_steps(kernels, args)


if __name__ == "__main__":
    main()
