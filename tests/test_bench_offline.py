"""The offline benchmark's smoke run: every figure present and positive (speed is not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eaglesrv.bench_offline import parse_args


def test_smoke_flags_fill_only_what_was_not_given() -> None:
    args = parse_args(["--smoke", "--num-prompts", "3"])
    assert (args.dtypes, args.decode_tokens, args.repeats, args.num_prompts) == (["float32"], 8, 1, 3)
    full = parse_args([])
    assert (full.dtypes, full.decode_tokens, full.concurrency, full.max_output_len) == (
        ["float32", "bfloat16"], 128, 32, 256)


@pytest.mark.slow
def test_smoke_run_reports_every_figure(tmp_path) -> None:
    out = tmp_path / "bench.json"
    # A subprocess, so that --threads does not leak into the other tests' torch. One thread:
    # on a 2-core machine shared with other jobs, two OpenMP threads can stall each other.
    cmd = [sys.executable, "-m", "eaglesrv.bench_offline", "--smoke", "--threads", "1", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| measurement | eaglesrv | transformers | ratio |" in proc.stdout

    results = json.loads(out.read_text())
    assert results["machine"]["cores"] >= 1 and results["machine"]["torch"]
    decode = results["decode"]["float32"]
    for side in ("eaglesrv", "transformers"):
        assert decode[side]["decode_tok_s"] > 0 and decode[side]["ttft_ms"] > 0
        assert len(decode[side]["runs_tok_s"]) == 1
    assert decode["ratio"] > 0
    assert decode["greedy_match"] is True  # same weights, fp32, greedy: same tokens

    batch = results["batch"]["float32"]
    assert batch["num_requests"] == 4 and batch["steps"] > 0
    for key in ("input_tokens", "output_tokens", "total_s", "output_tok_s", "req_s", "mean_running", "mean_ttft_ms",
                "transformers_batch1_tok_s", "ratio_to_transformers_batch1", "ratio_to_eaglesrv_batch1"):
        assert batch[key] > 0, key
    assert isinstance(batch["meets_8x_bar"], bool)
    assert 4 * 4 <= batch["output_tokens"] <= 4 * 16  # lengths clipped to [4, --max-output-len]

    scoring = results["scoring"]["float32"]
    assert scoring["num_requests"] == 4 and scoring["output_tokens"] == 4  # one token each, every prompt scored
    assert scoring["input_tokens"] == batch["input_tokens"] and scoring["transformers_batch1_s"] > 0
    assert "| loglikelihood scoring prompt tok/s, float32" in proc.stdout
