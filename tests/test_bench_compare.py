"""bench_compare: its configurations, its table and plot, and a smoke run that starts real servers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eaglesrv.bench.compare.configs import EagleTree, ServerVariant, build_configs
from eaglesrv.bench.compare.launcher import ManagedServer, ServerStartError
from eaglesrv.bench.compare.report import JSON_NAME, MARKDOWN_NAME, PLOT_NAME, pool_rounds, write_outputs
from eaglesrv.bench.compare.run import schedule
from eaglesrv.bench_compare import build_variants, main, parse_args, run_context, source_revision

# The run the issue asks for, word for word.
ISSUE_COMMAND = (
    "--num-prompts 100 --concurrencies 1,4,16,64 --speculative-draft-model-path HEAD --eagle-configs 5,8,32 3,1,4 "
    "--output-dir docs/bench_compare_cpu --server-args '--num-threads 2 --max-total-tokens 65536' "
    "--sharegpt-output-len 256"
)


def test_the_issues_command_line_means_plain_and_two_eagle3_servers() -> None:
    args = parse_args(shlex.split(ISSUE_COMMAND))
    assert (args.num_prompts, args.concurrencies, args.sharegpt_output_len) == (100, (1, 4, 16, 64), 256)
    configs = build_configs(args.speculative_draft_model_path, args.eagle_configs, args.config)
    assert [c.name for c in configs] == ["plain", "eagle3 (5,8,32)", "eagle3 (3,1,4)"]
    assert configs[0].server_args == ()
    assert " ".join(configs[2].server_args) == (
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --disable-speculative-adaptive")
    assert args.server_args == "--num-threads 2 --max-total-tokens 65536" and args.sharegpt_split == "heldout"


def test_configuration_flags() -> None:
    assert parse_args(["--speculative-draft-model-path", "H"]).eagle_configs == [EagleTree(5, 8, 32)]
    defaults = parse_args([])
    assert (defaults.eagle_configs, defaults.num_prompts, defaults.concurrencies) == ([], 100, (1, 4, 16, 64))
    extra = build_configs(None, [], ['adaptive=--speculative-algorithm EAGLE3 --x "a b"'])
    assert extra[1].name == "adaptive" and extra[1].server_args == ("--speculative-algorithm", "EAGLE3", "--x", "a b")
    with pytest.raises(ValueError, match="draft-model-path"):
        build_configs(None, [EagleTree(3, 1, 4)])
    shipped = build_configs(None, [EagleTree(3, 1, 4)], default_model=True)  # the default model's own head
    assert "--speculative-draft-model-path" not in shipped[1].server_args
    assert shipped[1].server_args[:2] == ("--speculative-algorithm", "EAGLE3")
    adaptive = parse_args(["--speculative-draft-model-path", "H", "--adaptive-configs", "5,8,32"])
    configs = build_configs(
        adaptive.speculative_draft_model_path, adaptive.eagle_configs, [], adaptive.adaptive_configs)
    assert [c.name for c in configs] == ["plain", "eagle3 (5,8,32)", "adaptive (<=5,8,32)"]
    assert configs[1].server_args == configs[2].server_args + ("--disable-speculative-adaptive",)
    with pytest.raises(ValueError, match="must differ"):
        build_configs(None, [], ["plain=--num-threads 1"])
    with pytest.raises(ValueError, match="STEPS,TOPK"):
        EagleTree.parse("5,8")
    with pytest.raises(ValueError, match="picks the server's host and port"):
        ManagedServer(["--port", "1"], log_path="unused.log")


def source_tree(root: Path, launch: str = "") -> Path:
    """A directory laid out like an eaglesrv checkout: root/eaglesrv/__init__.py (and launch.py)."""
    (root / "eaglesrv").mkdir(parents=True)
    (root / "eaglesrv" / "__init__.py").write_text("")
    if launch:
        (root / "eaglesrv" / "launch.py").write_text(launch)
    return root


def test_config_source_runs_that_configuration_from_the_given_tree(tmp_path, monkeypatch) -> None:
    before = source_tree(tmp_path / "before")
    args = parse_args(["--config", "before=--num-threads 1", "--config", "after=--num-threads 1",
                       "--config-source", f"before={before}"])
    configs = build_variants(args)
    assert [(c.name, c.source_dir) for c in configs] == [("plain", None), ("before", before), ("after", None)]
    adaptive = build_variants(parse_args(["--speculative-draft-model-path", "H", "--eagle-configs", "3,1,4",
                                          "--adaptive-configs", "5,8,32",
                                          "--config-source", f"adaptive (<=5,8,32)={before}"]))
    assert adaptive[2].name == "adaptive (<=5,8,32)" and adaptive[2].source_dir == before  # a name with "="

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    server = ManagedServer(configs[1].server_args, tmp_path / "before.log", source_dir=configs[1].source_dir)
    assert server.command[1:3] == ["-m", "eaglesrv.launch"]  # the same command; only the path differs
    assert server.env["PYTHONPATH"] == os.pathsep.join([str(before), "/elsewhere"])
    assert server.env["PYTHONSAFEPATH"] == "1"  # else the working directory's eaglesrv/ comes first
    installed = ManagedServer(configs[2].server_args, tmp_path / "after.log").env
    assert installed["PYTHONPATH"] == "/elsewhere" and "PYTHONSAFEPATH" not in installed

    # The JSON records each tree; a tree that is a git checkout of its own, its revision too.
    context = run_context(args, [], configs, (), [], 2)
    assert "source_dir" not in context["configs"][0]
    assert (context["configs"][1]["source_dir"], context["configs"][1]["source_revision"]) == (str(before), None)
    git = ["git", "-C", str(before), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "before"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert head.startswith(source_revision(before))


def test_the_server_really_imports_eaglesrv_from_the_source_tree(tmp_path, monkeypatch) -> None:
    # Run from this checkout, whose own eaglesrv/ `python -m` would otherwise find first.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    tree = source_tree(tmp_path / "tree", launch="import eaglesrv; print('imported', eaglesrv.__file__); exit(3)")
    server = ManagedServer([], tmp_path / "server.log", startup_timeout_s=60, source_dir=tree)
    with pytest.raises(ServerStartError, match="exited with 3") as failed:
        server.start()
    assert f"imported {tree / 'eaglesrv' / '__init__.py'}" in str(failed.value)


@pytest.mark.parametrize("flags, message", [
    (["--config-source", "nobody=."], "no configuration has that name"),
    (["--config-source", "plain"], 'takes "NAME=DIR"'),
    (["--config-source", "plain=NOT_A_TREE"], "has no eaglesrv/__init__.py"),
    (["--config-source", "plain=TREE", "--config-source", "plain=TREE"], "given twice"),
])
def test_a_bad_config_source_stops_before_any_server_starts(tmp_path, monkeypatch, flags, message) -> None:
    tree = source_tree(tmp_path / "tree")
    flags = [f.replace("NOT_A_TREE", str(tmp_path)).replace("TREE", str(tree)) for f in flags]

    def too_late(*_args, **_kwargs):
        raise AssertionError("the check must come before the tokenizer, the prompts and the servers")

    monkeypatch.setattr("eaglesrv.bench_compare.load_tokenizer", too_late)
    monkeypatch.setattr("eaglesrv.bench_compare.run_comparison", too_late)
    with pytest.raises(SystemExit, match=message):
        main(flags)


def fake_run(config: str, concurrency: int, throughput: float, accept: float | None = None, round_number: int = 1,
             tokens: int = 100, itl: float = 20.0) -> dict:
    return {"config": config, "max_concurrency": concurrency, "round": round_number, "request_rate": float("inf"),
            "completed": 4, "failed": 0, "total_output_tokens": tokens, "duration": tokens / throughput,
            "output_throughput": throughput, "accept_length": accept, "mean_ttft_ms": 100.0,
            "median_ttft_ms": 90.0, "mean_itl_ms": itl, "median_itl_ms": itl - 1}


def test_rounds_alternate_the_order_and_keep_one_concurrency_together() -> None:
    a, b, c = (ServerVariant(name, ()) for name in "abc")
    assert schedule([a, b], [1, 4], 1) == [(a, 1, 1), (a, 4, 1), (b, 1, 1), (b, 4, 1)]  # one server at a time
    assert [(cfg.name, conc, r) for cfg, conc, r in schedule([a, b, c], [1, 4], 3)] == [
        ("a", 1, 1), ("b", 1, 1), ("c", 1, 1), ("c", 1, 2), ("b", 1, 2), ("a", 1, 2), ("a", 1, 3), ("b", 1, 3),
        ("c", 1, 3), ("a", 4, 1), ("b", 4, 1), ("c", 4, 1), ("c", 4, 2), ("b", 4, 2), ("a", 4, 2), ("a", 4, 3),
        ("b", 4, 3), ("c", 4, 3)]
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_rounds_pool_tokens_over_time_and_pair_ratios_within_a_round(tmp_path) -> None:
    # Round 2 ran on a machine twice as slow: each round's ratio is 2.0 for "fast", and
    # pooling keeps 2.0, where comparing fast's round 2 with plain's round 1 would not.
    runs = [fake_run("plain", 1, 10.0, tokens=100), fake_run("fast", 1, 20.0, 1.5, tokens=100, itl=10.0),
            fake_run("fast", 1, 10.0, 1.7, round_number=2, tokens=100, itl=30.0),
            fake_run("plain", 1, 5.0, round_number=2, tokens=100)]
    rows = {row["config"]: row for row in pool_rounds(runs)}
    assert [r["output_throughput_vs_plain"] for r in runs] == [1.0, 2.0, 2.0, 1.0]
    fast = rows["fast"]
    assert fast["output_throughput"] == pytest.approx(200 / 15.0)  # 200 tokens over 5 s + 10 s
    assert fast["output_throughput_vs_plain"] == pytest.approx((200 / 15.0) / (200 / 30.0))
    assert (fast["rounds"], fast["completed"], fast["vs_plain_each_round"]) == (2, 8, [2.0, 2.0])
    assert (fast["accept_length"], fast["mean_itl_ms"], fast["median_itl_ms"]) == (pytest.approx(1.6), 20.0, 19.0)
    write_outputs(tmp_path, runs, {"title": "t"}, [])
    table = (tmp_path / MARKDOWN_NAME).read_text()
    assert "| vs plain, each round |" in table and "| 1 | fast | 13.3 | 2.00x | 2.00-2.00x | 1.60 |" in table
    saved = json.loads((tmp_path / JSON_NAME).read_text())
    assert len(saved["runs"]) == 4 and [r["config"] for r in saved["table"]] == ["plain", "fast"]


def test_outputs_hold_one_row_per_run_with_the_ratio_to_plain(tmp_path) -> None:
    runs = [fake_run("plain", 1, 10.0), fake_run("plain", 4, 30.0),
            fake_run("eagle3 (3,1,4)", 1, 20.0, 2.5), fake_run("eagle3 (3,1,4)", 4, 15.0, 2.4)]
    paths = write_outputs(tmp_path, runs, {"title": "t"}, ["header line"])
    table = (tmp_path / MARKDOWN_NAME).read_text().splitlines()
    assert table[0] == "header line"
    rows = [line for line in table if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[:5] for row in rows] == [
        ["| 1", "plain", "10.0", "1.00x", "-"], ["| 1", "eagle3 (3,1,4)", "20.0", "2.00x", "2.50"],
        ["| 4", "plain", "30.0", "1.00x", "-"], ["| 4", "eagle3 (3,1,4)", "15.0", "0.50x", "2.40"]]
    # Strict JSON (no Infinity), so any JSON reader takes it.
    saved = json.loads(paths["json"].read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON {name}"))
    assert [r["output_throughput_vs_plain"] for r in saved["runs"]] == [1.0, 1.0, 2.0, 0.5]
    assert saved["runs"][0]["request_rate"] == "inf"
    assert (tmp_path / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def small_random_head(head_dir) -> str:
    """A random EAGLE-3 head for the default model, with a 1,024-token draft vocabulary: quick to write."""
    import torch

    from eaglesrv.engine.eagle3.draft_model import Eagle3Config, Eagle3DraftModel
    from eaglesrv.engine.eagle3.head_io import head_config_for, save_head
    from eaglesrv.engine.loader import resolve_model
    from eaglesrv.engine.model.arch import ModelArch

    arch = ModelArch.from_hf_config(resolve_model(None, load_format="dummy").hf_config)
    config = head_config_for(arch, draft_vocab_size=1024)
    head = Eagle3DraftModel(Eagle3Config.from_hf_config(config))
    head.init_random_weights(0, torch.zeros(arch.vocab_size, arch.hidden_size))
    save_head(head, config, head_dir)  # without embed_tokens: the server uses the target's
    return str(head_dir)


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [1, 2])
def test_smoke_run_starts_each_server_and_writes_a_complete_comparison(tmp_path, rounds) -> None:
    from eaglesrv.bench.serving.metrics import missing_report_lines
    from eaglesrv.bench.serving.tokenizer import load_tokenizer

    head = small_random_head(tmp_path / "head")
    # A tokenizer directory spares each server the GGUF tokenizer conversion; dummy weights
    # spare it the dequantization. What is checked here is the tool, not the model.
    load_tokenizer(None).save_pretrained(str(tmp_path / "tokenizer"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eaglesrv.bench_compare", "--smoke", "--num-prompts", "2",
           "--sharegpt-output-len", "4", "--tokenizer", str(tmp_path / "tokenizer"),
           "--speculative-draft-model-path", head, "--eagle-configs", "2,1,3", "--output-dir", str(out),
           "--disable-tqdm", "--rounds", str(rounds),
           "--server-args", "--num-threads 1 --load-format dummy --max-total-tokens 2048"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Smoke check: every configuration and concurrency ran" in proc.stdout

    reports = proc.stdout.split("Serving Benchmark Result")[1:]
    assert len(reports) == 4 * rounds and all(missing_report_lines(r) == [] for r in reports)
    assert proc.stdout.count(": python -m eaglesrv.launch ") == 2  # one start per server, whatever the rounds
    saved = json.loads((out / JSON_NAME).read_text())
    runs = {(r["config"], r["max_concurrency"], r["round"]): r for r in saved["runs"]}
    assert sorted(runs) == sorted((config, c, r) for config in ("eagle3 (2,1,3)", "plain") for c in (1, 2)
                                  for r in range(1, rounds + 1))
    assert all(r["completed"] == 2 and r["total_output_tokens"] == 8 for r in runs.values())
    assert runs["eagle3 (2,1,3)", 1, 1]["accept_length"] >= 1.0 and runs["plain", 1, 1]["accept_length"] is None
    assert runs["plain", 2, rounds]["output_throughput_vs_plain"] == 1.0
    rows = {(r["config"], r["max_concurrency"]): r for r in saved["table"]}
    assert len(rows) == 4 and all(row["rounds"] == rounds for row in rows.values())
    assert rows["eagle3 (2,1,3)", 2]["completed"] == 2 * rounds
    assert saved["configs"][1]["server_args"][:2] == ["--tokenizer-path", str(tmp_path / "tokenizer")]
    table = (out / MARKDOWN_NAME).read_text()
    assert table.count("| eagle3 (2,1,3) |") == 2 and table.count("| plain |") == 2
    assert ("each round" in table) == (rounds > 1)
    assert (out / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "runs.jsonl").read_text().splitlines()) == 4 * rounds
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["eagle3-2-1-3.log", "plain.log"]
