"""The Markdown table `bench_offline` prints: eaglesrv against transformers, measurement by measurement."""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:,.1f}{unit}"


def _ratio(ours: float | None, theirs: float | None, higher_is_better: bool = True) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def markdown_table(results: dict[str, Any]) -> str:
    """Rows: measurements; columns: eaglesrv, transformers, ratio (>1 means eaglesrv is better)."""
    m, cfg = results["machine"], results["config"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, transformers {m['transformers']}; model {cfg['model']}; "
        f"1-min load average {m['load_average_1m']} at start, {m.get('load_average_1m_end')} at end",
        "",
        "| measurement | eaglesrv | transformers | ratio |",
        "|---|---:|---:|---:|",
    ]
    for dtype, d in results["decode"].items():
        ours, theirs = d["eaglesrv"], d.get("transformers")
        tput = (ours["decode_tok_s"], theirs and theirs["decode_tok_s"])
        ttft = (ours["ttft_ms"], theirs and theirs["ttft_ms"])
        lines.append(f"| batch-1 decode tok/s, {dtype}, {cfg['decode_tokens']} tokens "
                     f"(median of {cfg['repeats']}) | {_fmt(tput[0])} | {_fmt(tput[1])} | {_fmt(_ratio(*tput), 'x')} |")
        lines.append(f"| batch-1 TTFT ms, {dtype} ({d['prompt_tokens']}-token prompt) "
                     f"| {_fmt(ttft[0])} | {_fmt(ttft[1])} | {_fmt(_ratio(*ttft, higher_is_better=False), 'x')} |")
    for dtype, b in results["batch"].items():
        hf_rate = b.get("transformers_batch1_tok_s")
        lines.append(f"| continuous batching output tok/s, {dtype}, {b['num_requests']} ShareGPT prompts, "
                     f"{cfg['concurrency']} in flight ({b['output_tokens']} out tokens, {b['total_s']:.1f} s) "
                     f"vs transformers batch-1 | {_fmt(b['output_tok_s'])} | {_fmt(hf_rate)} "
                     f"| {_fmt(_ratio(b['output_tok_s'], hf_rate), 'x')} |")
    for dtype, sc in results.get("scoring", {}).items():
        theirs_s = sc.get("transformers_batch1_s")
        what = (f"{sc['num_requests']} ShareGPT prompts ({sc['input_tokens']} tokens) scored, {cfg['concurrency']} in "
                f"flight, vs transformers one at a time")
        ours_tok, theirs_tok = sc["input_tokens"] / sc["total_s"], theirs_s and sc["input_tokens"] / theirs_s
        ours_req, theirs_req = sc["req_s"], theirs_s and sc["num_requests"] / theirs_s
        lines.append(f"| loglikelihood scoring prompt tok/s, {dtype}, {what} | {_fmt(ours_tok)} | {_fmt(theirs_tok)} "
                     f"| {_fmt(_ratio(ours_tok, theirs_tok), 'x')} |")
        theirs_text = "n/a" if not theirs_req else f"{theirs_req:,.2f}"
        lines.append(f"| loglikelihood requests/s, {dtype} | {ours_req:,.2f} | {theirs_text} "
                     f"| {_fmt(_ratio(ours_req, theirs_req), 'x')} |")
    bars = [f"{dtype} {'met' if b['meets_8x_bar'] else 'not met'}"
            for dtype, b in results["batch"].items() if b.get("meets_8x_bar") is not None]
    if bars:
        lines += ["", "Bar (continuous batching >= 8x transformers' batch-1 decode rate): " + ", ".join(bars)]
    return "\n".join(lines)
