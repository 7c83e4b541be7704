"""Measure the cost model on the machine at hand, once, and cache it.

Target passes are timed at row counts 1, 2, 4, ... up to the most one step can carry, with
the rows spread over requests of `nodes` rows each (tree-mask spans, as verification runs
them) behind CONTEXT_TOKENS cached tokens each (fewer when the KV pool is smaller); the
output layer (logits and argmax) at the same row counts; draft passes like target passes,
with topk rows per request. The price of attention per context token comes from the same
kind of passes timed at two depths (_attention_prices). Each point is the fastest of three
sweeps over the whole ladder after one warm-up, and a point below a smaller size's is
raised to it (CostCurve.monotone). The result is cached under
$EAGLESRV_CACHE/cost_models, keyed by everything that changes it (model shapes, dtype,
device, threads, attention backend, page size, torch version).

A key cannot say whether the machine was busy when the model was measured. A model cached
while the cores were shared priced a one-row target pass at 80 ms against 59 ms measured
idle (4 rows: 141 against 117), so speculation looked cheaper beside plain decoding than
it was, and adaptive ran at 0.82x plain at concurrency 1 (2-core AMD EPYC, float32). So a
cached model is spot-checked at every start (_overpricing: about a second there) and
measured again when it prices a step more than STALE_TOLERANCE above a fresh timing. The
check is one-sided because timing noise is: a busy machine only makes passes slower, so a
fresh timing below the cached price shows the cache was measured busy, while one above it
shows only that the machine is busy now, which the learnt correction absorbs.

Under tensor parallelism every rank runs the same timed passes (their collectives pair
up), and rank 0's cache, spot check and timings decide for all (TensorParallel.leader_value).
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
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.scheduler.page_allocator import PageAllocator
from eaglesrv.utils.package_fetch import default_cache_dir

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 128
DEEP_CONTEXT_TOKENS = 1024  # the second depth, for the price of attention per context token
SLOPE_REQUESTS = 8  # requests in the passes timed at both depths
SLOPE_ROWS = 4  # target rows per request in them (a tree-masked span, as verification runs)
MAX_TARGET_ROWS = 2048
MAX_DRAFT_ROWS = 1024
FORMAT = 4  # bump when what is measured changes
STALE_TOLERANCE = 0.15  # a cached model pricing a step this far above a fresh timing is measured again
SPOT_CHECK_REPEATS = 10  # sweeps of the spot check's passes; each pass's fastest counts, as in measure()


def load_or_measure(runner, pages: PageAllocator, max_requests: int, cache_dir: Path | None = None) -> CostModel:
    """The cached cost model for this engine, measuring it first if there is none."""
    tp = runner.target.tp
    context = measuring_context(runner, pages.num_free)
    path = (cache_dir or default_cache_dir() / "cost_models") / f"{_cache_key(runner, context)}.json"
    cached = tp.leader_value(lambda: path.read_text() if path.exists() else None, startup=True)
    if cached is not None:
        model = CostModel.from_json(json.loads(cached))
        measured = _overpricing(runner, pages, context, model)
        overpricing = tp.leader_value(lambda: measured, startup=True)
        if overpricing <= STALE_TOLERANCE:
            logger.info("Speculation cost model: loaded %s (it holds against a spot check)", path)
            return model
        logger.warning("Speculation cost model: the cached %s prices a step %.0f%% above a fresh timing (it was "
                       "measured while the machine was busy); measuring it again", path, 100 * overpricing)
    started = time.monotonic()
    measured = measure(runner, pages, max_requests, context)
    model = tp.leader_value(lambda: measured, startup=True)
    if not tp.is_leader:
        return model
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(model.to_json(), indent=1))
    temporary.rename(path)
    logger.info("Speculation cost model: measured in %.1f s, cached at %s; target pass %.1f ms at 1 row, "
                "%.1f ms at %d rows, +%.2f us per row per context token", time.monotonic() - started, path,
                1e3 * model.target.seconds[0], 1e3 * model.target.seconds[-1], model.target.rows[-1],
                1e6 * model.attention_s)
    return model


def measuring_context(runner, free_pages: int) -> int:
    """Cached tokens behind each measuring request: CONTEXT_TOKENS, or what a pool too
    small for one such request leaves (a tiny test pool must still start)."""
    page_size = runner.kv.page_size
    context = min(CONTEXT_TOKENS, free_pages * page_size - runner.decode_lookahead - 1)
    if context < 0:
        raise ValueError("the KV pool is too small to measure the speculation cost model")
    return context


def _measuring_request_pages(runner, context: int) -> int:
    """Pages of one measuring request: `context` cached tokens and the largest step's."""
    return math.ceil((context + runner.decode_lookahead + 1) / runner.kv.page_size)


@torch.inference_mode()
def measure(runner, pages: PageAllocator, max_requests: int, context: int = CONTEXT_TOKENS) -> CostModel:
    largest = runner.largest
    per_request_pages = _measuring_request_pages(runner, context)
    requests = min(max_requests, pages.num_free // per_request_pages)
    if requests < 1:
        raise ValueError("the KV pool is too small to measure the speculation cost model")
    with pages.borrowed([per_request_pages] * requests) as tables:
        target_rows = _ladder(min(MAX_TARGET_ROWS, requests * largest.nodes))
        draft_rows = _ladder(min(MAX_DRAFT_ROWS, requests * largest.topk))
        target = _best_times([lambda m=m: _target_pass(runner, tables, context, m, largest.nodes)
                              for m in target_rows])
        logits = _best_times([lambda m=m: _logits_pass(runner, m) for m in target_rows])
        draft = _best_times([lambda r=r: _draft_pass(runner, tables, context, r, largest.topk) for r in draft_rows])
    attention_s, draft_attention_s = _attention_prices(runner, pages, context)
    return CostModel(CostCurve.monotone(target_rows, target), CostCurve.monotone(target_rows, logits),
                     CostCurve.monotone(draft_rows, draft), context, attention_s, draft_attention_s)


@torch.inference_mode()
def _overpricing(runner, pages: PageAllocator, context: int, model: CostModel) -> float:
    """How far above fresh timings the model prices the two steps the policy weighs at low
    load, at most (0 when it prices neither above): a plain one-row pass and one request's
    largest tree (its draft passes and its verification). Whole steps, not single passes:
    a 3 ms draft pass jitters by more than the tolerance, and a draft pass of many rows
    timed alone ran 15-25% faster than inside the measurement's sweep."""
    largest = runner.largest
    per_request_pages = _measuring_request_pages(runner, context)
    if pages.num_free < per_request_pages:
        return 0.0
    with pages.borrowed([per_request_pages]) as tables:
        plain, verify, draft = _best_times([
            lambda: _target_pass(runner, tables, context, 1, largest.nodes),
            lambda: _target_pass(runner, tables, context, largest.nodes, largest.nodes),
            lambda: _draft_pass(runner, tables, context, largest.topk, largest.topk)], SPOT_CHECK_REPEATS)
    drafting = largest.steps - 1
    timed = [plain, verify + drafting * draft]
    priced = [float(model.target(1)), float(model.target(largest.nodes) + drafting * model.draft(largest.topk))]
    return max(0.0, max(price / fresh - 1.0 for price, fresh in zip(priced, timed)))


def _attention_prices(runner, pages: PageAllocator, context: int) -> tuple[float, float]:
    """Seconds per row per context token of a target and of a draft pass: the same passes
    timed with every request `context` and DEEP_CONTEXT_TOKENS deep. A pool too small for
    the deep passes leaves both at 0 (the model then ignores depth, as it did before)."""
    topk = runner.largest.topk
    span = max(SLOPE_ROWS, topk) + 1
    deep = min(DEEP_CONTEXT_TOKENS, runner.target.arch.max_position_embeddings - span)  # positions must exist
    per_request_pages = math.ceil((deep + span) / runner.kv.page_size)
    requests = min(SLOPE_REQUESTS, pages.num_free // per_request_pages)
    if requests < 1 or deep <= context:
        logger.info("Speculation cost model: the KV pool or context is too small to price attention by depth")
        return 0.0, 0.0
    target_rows, draft_rows = requests * SLOPE_ROWS, requests * topk
    with pages.borrowed([per_request_pages] * requests) as tables:
        shallow, deeper = _best_times([lambda d=d: _target_pass(runner, tables, d, target_rows, SLOPE_ROWS)
                                       for d in (context, deep)])
        draft_shallow, draft_deeper = _best_times([lambda d=d: _draft_pass(runner, tables, d, draft_rows, topk)
                                                   for d in (context, deep)])
    return (max(0.0, (deeper - shallow) / (target_rows * (deep - context))),
            max(0.0, (draft_deeper - draft_shallow) / (draft_rows * (deep - context))))


def _target_pass(runner, tables, context: int, rows: int, per_request: int) -> None:
    ids, positions, spans = _spans(tables, context, rows, per_request, runner.device)
    hidden, features = runner.target_pass(ids, positions, spans, runner.capture_layers)
    features[:1].cpu()  # waits for the pass on an accelerator


def _logits_pass(runner, rows: int) -> None:
    hidden = torch.zeros(rows, runner.target.arch.hidden_size, dtype=runner.kv.k.dtype, device=runner.device)
    runner.target.compute_logits(hidden).argmax(-1).tolist()  # verification reads every node's argmax


def _draft_pass(runner, tables, context: int, rows: int, per_request: int) -> None:
    ids, positions, spans = _spans(tables, context, rows, per_request, runner.device)
    features = torch.zeros(rows, runner.draft.config.arch.hidden_size, dtype=runner.kv.k.dtype,
                           device=runner.device)
    logits, _ = runner.draft_pass(ids, features, positions, spans)
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
        "dtype": str(runner.kv.k.dtype),
        "device": device_name,
        "threads": torch.get_num_threads(),
        "attention": runner.attention.name,
        "page_size": runner.kv.page_size,
        "largest": [runner.largest.steps, runner.largest.topk, runner.largest.nodes],
        "torch": torch.__version__,
    }
    if runner.target.tp.size > 1:
        described["tp_size"] = runner.target.tp.size
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
