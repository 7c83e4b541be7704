"""Measure the cost model on the machine at hand, once, and cache it.

Target passes are timed at row counts 1, 2, 4, ... up to the most one step can carry,
with the rows spread over requests of `nodes` rows each (tree-mask spans, as verification
runs them) behind CONTEXT_TOKENS cached tokens each (fewer when the KV pool is smaller); the output layer (logits and argmax)
at the same row counts; draft passes like target passes, with topk rows per request. Each point is the fastest of three sweeps over the whole ladder after one warm-up, and
a point below a smaller size's is raised to it (CostCurve.monotone). The result is cached
under $EAGLESRV_CACHE/cost_models, keyed by everything that changes it (model shapes,
dtype, device, threads, attention backend, page size, torch version).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eaglesrv.engine.adaptive.cost_model import CostCurve, CostModel
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.scheduler.page_allocator import PageAllocator
from eaglesrv.utils.package_fetch import default_cache_dir

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 128
MAX_TARGET_ROWS = 2048
MAX_DRAFT_ROWS = 1024
FORMAT = 3  # bump when what is measured changes


def load_or_measure(runner, pages: PageAllocator, max_requests: int, cache_dir: Path | None = None) -> CostModel:
    """The cached cost model for this engine, measuring it first if there is none."""
    context = measuring_context(runner, pages.num_free)
    path = (cache_dir or default_cache_dir() / "cost_models") / f"{_cache_key(runner, context)}.json"
    if path.exists():
        model = CostModel.from_json(json.loads(path.read_text()))
        logger.info("Speculation cost model: loaded %s", path)
        return model
    started = time.monotonic()
    model = measure(runner, pages, max_requests, context)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(model.to_json(), indent=1))
    temporary.rename(path)
    logger.info("Speculation cost model: measured in %.1f s, cached at %s; target pass %.1f ms at 1 row, "
                "%.1f ms at %d rows", time.monotonic() - started, path, 1e3 * model.target.seconds[0],
                1e3 * model.target.seconds[-1], model.target.rows[-1])
    return model


def measuring_context(runner, free_pages: int) -> int:
    """Cached tokens behind each measuring request: CONTEXT_TOKENS, or what a pool too
    small for one such request leaves (a tiny test pool must still start)."""
    page_size = runner.target_kv.page_size
    context = min(CONTEXT_TOKENS, free_pages * page_size - runner.lookahead - 1)
    if context < 0:
        raise ValueError("the KV pool is too small to measure the speculation cost model")
    return context


@torch.inference_mode()
def measure(runner, pages: PageAllocator, max_requests: int, context: int = CONTEXT_TOKENS) -> CostModel:
    largest = runner.largest
    page_size = runner.target_kv.page_size
    per_request_pages = math.ceil((context + runner.lookahead + 1) / page_size)
    requests = min(max_requests, pages.num_free // per_request_pages)
    if requests < 1:
        raise ValueError("the KV pool is too small to measure the speculation cost model")
    tables = [pages.allocate(per_request_pages) for _ in range(requests)]
    try:
        target_rows = _ladder(min(MAX_TARGET_ROWS, requests * largest.nodes))
        draft_rows = _ladder(min(MAX_DRAFT_ROWS, requests * largest.topk))
        target = _best_times([lambda m=m: _target_pass(runner, tables, context, m, largest.nodes)
                              for m in target_rows])
        logits = _best_times([lambda m=m: _logits_pass(runner, m) for m in target_rows])
        draft = _best_times([lambda r=r: _draft_pass(runner, tables, context, r, largest.topk) for r in draft_rows])
    finally:
        for table in tables:
            pages.free(table)
    return CostModel(CostCurve.monotone(target_rows, target), CostCurve.monotone(target_rows, logits),
                     CostCurve.monotone(draft_rows, draft), context)


def _target_pass(runner, tables, context: int, rows: int, per_request: int) -> None:
    ids, positions, spans = _spans(tables, context, rows, per_request, runner.device)
    ctx = ForwardContext(runner.attention, runner.attention.plan(spans), runner.target_kv)
    hidden, features = runner.target(ids, positions, ctx, runner.capture_layers)
    features[:1].cpu()  # waits for the pass on an accelerator


def _logits_pass(runner, rows: int) -> None:
    hidden = torch.zeros(rows, runner.target.arch.hidden_size, dtype=runner.target_kv.k.dtype, device=runner.device)
    runner.target.compute_logits(hidden).argmax(-1).tolist()  # verification reads every node's argmax


def _draft_pass(runner, tables, context: int, rows: int, per_request: int) -> None:
    ids, positions, spans = _spans(tables, context, rows, per_request, runner.device)
    ctx = ForwardContext(runner.attention, runner.attention.plan(spans), runner.draft_kv)
    features = torch.zeros(rows, runner.draft.config.arch.hidden_size, dtype=runner.target_kv.k.dtype,
                           device=runner.device)
    logits, _ = runner.draft(ids, features, positions, ctx)
    torch.log_softmax(logits, dim=-1).cpu()


def _spans(tables, context: int, rows: int, per_request: int, device):
    spans, positions = [], []
    left = rows
    for table in tables:
        if left == 0:
            break
        n = min(per_request, left)
        mask = torch.ones(n, context + n, dtype=torch.bool).tril(context) if n > 1 else None
        spans.append(SequenceSpan(table, context, n, mask))
        positions.extend(range(context, context + n))
        left -= n
    if left:
        raise AssertionError("not enough measuring requests for the rows asked")
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    return ids, torch.tensor(positions, device=device), spans


def _best_times(runs, repeats: int = 3) -> list[float]:
    """The fastest of `repeats` timings of each run, after one warm-up of each. The ladder is
    swept whole each time, so a stall of the machine lands on different sizes, not on
    every repeat of one."""
    for run in runs:
        run()  # warm-up: first calls at a size pay for allocation and kernel set-up
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for index, run in enumerate(runs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            began = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[index] = min(best[index], time.perf_counter() - began)
    return best


def _ladder(limit: int) -> list[int]:
    values, value = [], 1
    while value < limit:
        values.append(value)
        value *= 2
    return values + [limit]


def _cache_key(runner, context: int) -> str:
    device = runner.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    described = {
        "format": FORMAT,
        "target": asdict(runner.target.arch),
        "draft": asdict(runner.draft.config.arch),
        "draft_vocab": runner.draft.config.draft_vocab_size,
        "dtype": str(runner.target_kv.k.dtype),
        "device": device_name,
        "threads": torch.get_num_threads(),
        "attention": runner.attention.name,
        "page_size": runner.target_kv.page_size,
        "largest": [runner.largest.steps, runner.largest.topk, runner.largest.nodes],
        "torch": torch.__version__,
    }
    if context != CONTEXT_TOKENS:  # a model measured in a tiny pool is not reused by a normal one
        described["context"] = context
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
