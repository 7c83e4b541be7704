"""bench_gpu, the benchmark scripts/gpu_check.sh runs: on the CPU with the tiny shape every
row of its table gets a number; the shipped Llama-3.1-8B shape and its weight-streaming
floors; the table with gpu_check's parts above the figures. No timed asserts."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import TINY_LLAMA

from eaglesrv import bench_gpu
from eaglesrv.bench.gpu.measure import BANDWIDTHS, Floor, table_bandwidth, weight_bytes
from eaglesrv.bench.gpu.report import MEASUREMENTS, markdown_table
from eaglesrv.configs.shapes import shape_names, shape_path
from eaglesrv.engine.loader import resolve_model
from eaglesrv.engine.model.arch import ModelArch


def _measurement_rows(table: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| check ")]
    return [row for row in rows if row[0].startswith(("batch-1", "EAGLE-3", "shared prefix")) or "concurrent" in row[0]]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One --smoke run on the CPU: the shipped tiny shape, a directory holding only config.json."""
    out = tmp_path_factory.mktemp("bench_gpu") / "bench.json"
    status = bench_gpu.main(["--smoke", "--device", "cpu", "--output-json", str(out)])
    return status, json.loads(out.read_text())


def test_smoke_run_fills_every_row(smoke_run, capsys):
    status, results = smoke_run
    assert status == 0
    for key in MEASUREMENTS:
        assert "error" not in results[key], results[key]
    assert results["decode_graphs"]["tok_s"] > 0 and results["decode_eager"]["tok_s"] > 0
    assert results["batch"]["output_tokens"] == 4 * 8  # every request produced its planned length
    assert results["eagle"]["ratio"] > 0 and results["eagle"]["tokens_per_round"] >= 1
    assert results["eagle"]["draft_vocab_size"] == 128  # a head written with a reduced vocabulary, then loaded
    prefix = results["prefix"]
    for run in (prefix["cache_off"], prefix["cache_on"]):
        assert run["output_tokens"] == 2 * 4 * 4 and run["mean_ttft_ms"] > 0
    # The 3 requests of each group after its first find 2 pages of 16 of the 48-token system
    # prompt cached (a page's key holds the token after it, the question's first); without
    # the cache, nothing is.
    assert prefix["cache_off"]["cached_prompt_tokens"] == 0 and prefix["cache_on"]["cached_prompt_tokens"] == 6 * 32
    assert results["floor"]["weight_bytes"] == weight_bytes(ModelArch.from_hf_config(TINY_LLAMA), torch.float32)
    table = markdown_table(results)
    rows = _measurement_rows(table)
    assert len(rows) == 5
    for what, result, target, verdict in rows:
        assert re.search(r"\d", result) and not result.startswith("failed"), (what, result)
        assert verdict != "FAILED"


def test_the_table_can_be_printed_again_with_the_checks(smoke_run, tmp_path, capsys):
    _, results = smoke_run
    (tmp_path / "bench.json").write_text(json.dumps(results))
    (tmp_path / "parts.tsv").write_text("machine\t0\t4\tNVIDIA H200 140 GiB\nGPU tests\t124\t230\t3 passed\n"
                                        "sm90 compile report\tskipped\t0\tnot run\n")
    assert bench_gpu.main(["--table", str(tmp_path / "bench.json"), "--checks", str(tmp_path / "parts.tsv")]) == 0
    table = capsys.readouterr().out
    assert "| machine | NVIDIA H200 140 GiB (4 s) | - | ok |" in table
    assert "| GPU tests | 3 passed (230 s) | - | FAILED: timed out (exit 124) |" in table
    assert "| sm90 compile report | not run | - | skipped |" in table
    assert len(_measurement_rows(table)) == 5


def test_a_failed_part_keeps_the_other_rows(smoke_run):
    _, results = smoke_run
    results = {**results, "batch": {"error": "RuntimeError: out of memory"}, "device": {
        **results["device"], "type": "cuda", "name": "NVIDIA H200"}}
    graphs, eager, batch, eagle, prefix = _measurement_rows(markdown_table(results))
    assert batch[1:] == ["failed: RuntimeError: out of memory", "-", "FAILED"]
    assert graphs[0].startswith("batch-1 decode, CUDA graphs") and graphs[3] in ("met", "NOT met")
    assert eager[3] == "-" and eagle[3] in ("met", "NOT met") and prefix[3] in ("met", "NOT met")
    assert markdown_table(None).endswith("| benchmarks | no results (bench_gpu wrote no JSON) | - | FAILED |")
    # A run from before the shared-prefix part: its row says it did not run.
    older = {**results, "config": {k: v for k, v in results["config"].items() if not k.startswith("gsp_")}}
    del older["prefix"]
    assert _measurement_rows(markdown_table(older))[4][1:] == ["not run", "-", "-"]


def test_targets_judge_the_figures():
    results = {
        "config": {"decode_tokens": 128, "repeats": 3, "concurrency": 128, "input_len": 256, "output_len": 256,
                   "spec_steps": 5, "spec_topk": 8, "spec_nodes": 32, "shape": "llama-3.1-8b", "dtype": "bfloat16",
                   "gsp_num_groups": 8, "gsp_prompts_per_group": 16, "gsp_system_prompt_len": 2048,
                   "gsp_question_len": 128, "gsp_output_len": 64, "gsp_concurrency": 16},
        "device": {"type": "cuda", "name": "NVIDIA H200", "torch": "2.11"},
        "floor": Floor(16_060_000_000, 4.26e12, "H200, measured copy").to_json(),
        "decode_graphs": {"tok_s": 231.0}, "decode_eager": {"tok_s": 60.0},
        "batch": {"output_tok_s": 9_999.0, "output_tokens": 32768, "total_s": 3.3},
        "eagle": {"ratio": 1.59, "round_ms": 6.0, "plain_step_ms": 3.8, "tokens_per_round": 1.0},
        "prefix": {"cache_off": {"mean_ttft_ms": 300.0, "output_tok_s": 900.0},
                   "cache_on": {"mean_ttft_ms": 100.0, "output_tok_s": 1500.0, "cached_prompt_tokens": 250_000,
                                "input_tokens": 279_000},
                   "ttft_ratio": 3.0, "tok_s_ratio": 1.67},
    }
    verdicts = [row[3] for row in _measurement_rows(markdown_table(results))]
    assert verdicts == ["met", "-", "NOT met", "met", "met"]  # 231 / 265.3 = 87.1%; 9,999 < 10,000; 1.59 <= 1.6
    on_h100 = {**results, "device": {**results["device"], "name": "NVIDIA H100 80GB HBM3"}}
    assert _measurement_rows(markdown_table(on_h100))[2][3] == "n/a (not an H200)"


def test_the_llama_31_8b_shape_and_its_floors():
    source = resolve_model(str(shape_path("llama-3.1-8b")), "dummy")
    assert source.iter_weights is None and source.load_tokenizer is None  # config.json alone
    arch = ModelArch.from_hf_config(source.hf_config)
    shape = (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    assert shape == (4096, 32, 32, 8, 128)
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings) == (14336, 128256, 131072)
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_theta == 500000.0 and arch.rms_norm_eps == 1e-5
    assert arch.eos_token_ids == (128001, 128008, 128009) and arch.bos_token_id == 128000
    assert not arch.tie_word_embeddings
    nbytes = weight_bytes(arch, torch.bfloat16)
    assert nbytes == 2 * 8_030_261_248  # 16.06 GB, as ../shared/DESIGN.md counts it
    floors = {key: Floor(nbytes, bandwidth, source).tok_s for key, bandwidth, source in BANDWIDTHS}
    assert floors["H200"] == pytest.approx(265, abs=1) and floors["H100"] == pytest.approx(209, abs=2)
    assert table_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12 and table_bandwidth("NVIDIA H200")[0] == 4.26e12
    assert table_bandwidth("NVIDIA A100-SXM4-80GB") is None  # measured by a copy instead


def test_the_tiny_shape_is_the_tests_tiny_llama():
    assert set(shape_names()) >= {"llama-3.1-8b", "tiny-llama"}
    config = json.loads((shape_path("tiny-llama") / "config.json").read_text())
    assert {key: config[key] for key in TINY_LLAMA} == TINY_LLAMA
    with pytest.raises(ValueError, match="no model shape"):
        shape_path("llama-9")
