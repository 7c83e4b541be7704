"""The one table bench_gpu prints, and scripts/gpu_check.sh ends with: the checks that ran
(wheels, the machine, the GPU tests, the sm90 report, the benchmark run) when given, then
each figure beside the target issue 40 sets for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLOOR_FRACTION = 0.87  # batch-1 decode with graphs, of the weight-streaming floor
BATCH_TOK_S_H200 = 10_000  # 128 concurrent requests of 256 in / 256 out, on an H200
EAGLE_ROUND_RATIO = 1.6  # one EAGLE-3 (5, 8, 32) round, as a multiple of one plain decode step
PREFIX_TTFT_RATIO = 3.0  # issue 42: mean TTFT this many times lower with the prefix cache, shared-prefix workload

MEASUREMENTS = ("decode_graphs", "decode_eager", "batch", "eagle", "prefix")  # the rows bench_gpu fills, in order


def read_checks(path: str | Path) -> list[dict[str, Any]]:
    """gpu_check.sh's parts file: one line per part, name, exit status, seconds, last line (tab-separated)."""
    checks = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        name, rc, seconds, detail = (line.split("\t") + ["", "", ""])[:4]
        checks.append({"name": name, "rc": rc, "seconds": seconds, "detail": detail})
    return checks


def check_verdict(rc: str) -> str:
    if rc == "0":
        return "ok"
    if rc == "skipped":
        return "skipped"
    if rc in ("124", "137"):
        return f"FAILED: timed out (exit {rc})"
    return f"FAILED (exit {rc})"


def _cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ").strip() or "-"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1e3:.2f} kB"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _missing(what: str, figure: dict[str, Any] | None) -> tuple[str, str, str, str]:
    """The row of a measurement that failed (its error) or did not run (not in --parts, or the run died)."""
    if figure is None:
        return what, "not run", "-", "-"
    return what, f"failed: {figure['error']}", "-", "FAILED"


def measurement_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(what, result, target, verdict) for each measurement; a failed one says why."""
    cfg, floor = results["config"], results.get("floor") or {}
    floor = {} if "error" in floor else floor
    gpu = results.get("device", {}).get("name", "")
    floor_note = (f"{floor['tok_s']:,.1f} tok/s floor ({_bytes(floor['weight_bytes'])} at "
                  f"{_bytes(floor['bandwidth'])}/s, {floor['source']})" if floor else "no floor")
    rows = []

    def decode_row(key: str, label: str, target: bool) -> None:
        d = results.get(key)
        what = f"batch-1 decode, {label} ({cfg['decode_tokens']} tokens, median of {cfg['repeats']})"
        if d is None or "error" in d:
            rows.append(_missing(what, d))
            return
        share = d["tok_s"] / floor["tok_s"] if floor else None
        result = f"{d['tok_s']:,.1f} tok/s" + (f" = {100 * share:.1f}% of the {floor_note if target else 'floor'}"
                                               if share else "")
        if target:
            rows.append((what, result, f">= {100 * FLOOR_FRACTION:.0f}% of floor",
                         _verdict(share >= FLOOR_FRACTION) if share else "n/a"))
        else:
            rows.append((what, result, "(reported)", "-"))

    on_cuda = results["device"].get("type") == "cuda"
    decode_row("decode_graphs", "CUDA graphs" if on_cuda else "graphs (the CPU stand-in)", True)
    decode_row("decode_eager", "--disable-cuda-graph", False)

    b = results.get("batch")
    what = (f"{cfg['concurrency']} concurrent requests, {cfg['input_len']} in / {cfg['output_len']} out "
            "(random ids, EOS ignored), output tok/s")
    if b is None or "error" in b:
        rows.append(_missing(what, b))
    else:
        result = f"{b['output_tok_s']:,.1f} tok/s ({b['output_tokens']} tokens in {b['total_s']:.2f} s)"
        on_h200 = "H200" in gpu
        rows.append((what, result, f">= {BATCH_TOK_S_H200:,} on H200",
                     _verdict(b["output_tok_s"] >= BATCH_TOK_S_H200) if on_h200 else "n/a (not an H200)"))

    e = results.get("eagle")
    vocab = (e or {}).get("draft_vocab_size")
    what = (f"EAGLE-3 ({cfg['spec_steps']}, {cfg['spec_topk']}, {cfg['spec_nodes']}) at batch 1, random head"
            + (f" ({vocab:,}-token draft vocabulary)" if vocab else "")
            + ": one draft-and-verify round / one plain decode step")
    if e is None or "error" in e:
        rows.append(_missing(what, e))
    else:
        result = (f"{e['ratio']:.2f}x ({e['round_ms']:.2f} ms / {e['plain_step_ms']:.2f} ms; "
                  f"{e['tokens_per_round']:.2f} tokens per round)")
        rows.append((what, result, f"<= {EAGLE_ROUND_RATIO}x", _verdict(e["ratio"] <= EAGLE_ROUND_RATIO)))

    rows.append(_prefix_row(cfg, results.get("prefix")))
    return rows


def _prefix_row(cfg: dict[str, Any], p: dict[str, Any] | None) -> tuple[str, str, str, str]:
    gsp = {key: cfg.get(f"gsp_{key}", "?") for key in  # "?" in a run from before this part existed
           ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len", "concurrency")}
    what = (f"shared prefix ({gsp['num_groups']} x {gsp['prompts_per_group']} requests, "
            f"{gsp['system_prompt_len']}-token system prompts, {gsp['question_len']} in / "
            f"{gsp['output_len']} out, {gsp['concurrency']} in flight): mean TTFT, prefix cache off / on")
    if p is None or "error" in p:
        return _missing(what, p)
    off, on = p["cache_off"], p["cache_on"]
    result = (f"{p['ttft_ratio']:.2f}x ({off['mean_ttft_ms']:,.1f} ms / {on['mean_ttft_ms']:,.1f} ms); output "
              f"{on['output_tok_s']:,.1f} against {off['output_tok_s']:,.1f} tok/s ({p['tok_s_ratio']:.2f}x); "
              f"{on['cached_prompt_tokens']:,} of {on['input_tokens']:,} prompt tokens cached")
    return what, result, f">= {PREFIX_TTFT_RATIO:g}x", _verdict(p["ttft_ratio"] >= PREFIX_TTFT_RATIO)


def markdown_table(results: dict[str, Any] | None, checks: list[dict[str, Any]] | None = None) -> str:
    """A caption line, then one table: the checks (if given), then the measurements (if any)."""
    lines = []
    if results is not None:
        d, cfg = results["device"], results["config"]
        lines += [f"{d['name']}; torch {d['torch']}; {cfg['shape']}, {cfg['dtype']}, dummy weights; "
                  f"attention {d.get('attention', '?')}; bench_gpu ran {results.get('elapsed_s', 0):.0f} s", ""]
    lines += ["| check | result | target | verdict |", "|---|---|---|---|"]
    for check in checks or []:
        seconds = f" ({check['seconds']} s)" if check["seconds"] not in ("", "0") else ""
        lines.append(f"| {_cell(check['name'])} | {_cell(check['detail'])}{seconds} | - "
                     f"| {check_verdict(check['rc'])} |")
    if results is None:
        lines.append("| benchmarks | no results (bench_gpu wrote no JSON) | - | FAILED |")
    else:
        for row in measurement_rows(results):
            lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    return "\n".join(lines)
