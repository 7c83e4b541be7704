"""One `bench_serving` run against a live server: warm up, send every request, measure.

Requests leave at `request_rate` per second (Poisson arrivals; all at once when inf),
with at most `max_concurrency` in flight, as in SGLang. Multi-turn conversations
(`multiturn.ConversationRow`) are replayed turn by turn instead (see multiturn.py).
With `flush_cache`, the server's prefix cache is flushed after the warm-up, as SGLang's
--flush-cache does, so that the run starts cold whatever ran before it. The accept length is the server's:
with eaglesrv, the speculation counters of /get_server_info read before and after the
run, so it covers this run only (the server may have served others since it started);
with a server that reports only a running average (SGLang), that average.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import resource
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from eaglesrv.bench.serving.client import RequestInput, RequestRecord, api_path, request_func, start_spaced
from eaglesrv.bench.serving.dataset import DatasetRow
from eaglesrv.bench.serving.metrics import ServingMetrics, compute_metrics, format_report
from eaglesrv.bench.serving.multiturn import (
    ConversationRow,
    count_prompt_tokens,
    first_turn_row,
    format_turn_report,
    replay_conversations,
    turn_stats,
)

MAX_ERRORS_KEPT = 5
WARMUP_OUTPUT_LEN = 32  # SGLang's cap on the warm-up request's output


@dataclass(frozen=True)
class BenchSettings:
    backend: str
    base_url: str  # http://host:port, no trailing slash
    model: str
    request_rate: float = math.inf
    max_concurrency: int | None = None
    stream: bool = True
    ignore_eos: bool = True
    extra_request_body: dict[str, Any] = field(default_factory=dict)
    warmup_requests: int = 1
    seed: int = 1
    show_progress: bool = True
    progress_label: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # e.g. an API key
    flush_cache: bool = False  # POST /flush_cache after the warm-up

    @property
    def api_url(self) -> str:
        return self.base_url + api_path(self.backend)


@dataclass
class BenchResult:
    settings: BenchSettings
    duration_s: float
    metrics: ServingMetrics
    accept_length: float | None
    outputs: list[RequestRecord]
    turns: list[int] | None = None  # multi-turn runs: each output's turn number (1 for a first turn)

    @property
    def errors(self) -> list[str]:
        """The first few distinct errors of failed requests, in the order they occurred."""
        distinct = dict.fromkeys(o.error.strip() for o in self.outputs if not o.success)
        return list(distinct)[:MAX_ERRORS_KEPT]

    def report(self) -> str:
        s = self.settings
        text = format_report(s.backend, s.request_rate, s.max_concurrency, self.duration_s, self.metrics,
                             self.accept_length)
        if self.errors:
            counts = Counter(o.error.strip() for o in self.outputs if not o.success)
            shown = "\n".join(f"--- {counts[e]} request(s):\n{e}" for e in self.errors)
            text += f"\nFirst errors of the {self.metrics.failed} failed requests:\n{shown}"
        if self.turns is not None:
            text += "\n" + format_turn_report(turn_stats(self.outputs, self.turns), self.turns.count(1))
        return text

    def to_json(self, details: bool = False) -> dict[str, Any]:
        s = self.settings
        record = {
            "backend": s.backend, "model": s.model, "request_rate": s.request_rate,
            "max_concurrency": s.max_concurrency, "duration": self.duration_s,
            **_sglang_keys(self.metrics.to_json()), "accept_length": self.accept_length,
            "first_errors": self.errors,
        }
        if self.turns is not None:
            record.update(conversations=self.turns.count(1),
                          ttft_by_turn=[asdict(s) for s in turn_stats(self.outputs, self.turns)])
        if details:
            record.update(input_lens=[o.prompt_len for o in self.outputs],
                          output_lens=[o.output_len if o.success else 0 for o in self.outputs],
                          ttfts=[o.ttft for o in self.outputs], itls=[o.itl for o in self.outputs],
                          generated_texts=[o.generated_text for o in self.outputs],
                          errors=[o.error for o in self.outputs])
            if self.turns is not None:
                record["turns"] = self.turns
        return record


# SGLang's JSONL names for the totals; the other metrics keep their names there too.
_SGLANG_KEYS = {"total_input": "total_input_tokens", "total_output": "total_output_tokens",
                "total_output_retokenized": "total_output_tokens_retokenized"}


def _sglang_keys(metrics: dict[str, Any]) -> dict[str, Any]:
    return {_SGLANG_KEYS.get(k, k): v for k, v in metrics.items()}


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One run, one line (SGLang's --output-file format)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def raise_open_file_limit(target: int = 65535) -> None:
    """Every request in flight holds a socket; the usual soft limit of 1024 is too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass  # then the run is limited to what the system allows


def _new_client(settings: BenchSettings, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    # No pool limit: with --request-rate inf every request must be in flight at once.
    return httpx.AsyncClient(
        headers=settings.headers, transport=transport, timeout=httpx.Timeout(6 * 3600.0, connect=60.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def server_info(client: httpx.AsyncClient, base_url: str) -> dict | None:
    """internal_states[0] of /get_server_info, or None when the server has no such endpoint."""
    try:
        response = await client.get(base_url + "/get_server_info", timeout=30.0)
        if response.status_code != 200:
            return None
        states = response.json().get("internal_states") or [None]
        return states[0]
    except (httpx.HTTPError, ValueError):
        return None


def accept_length_between(before: dict | None, after: dict | None) -> float | None:
    """Accepted tokens per verification during the run; the server's average if it keeps no counters."""
    if not after:
        return None
    if before and "spec_verifications" in after and "spec_accepted_tokens" in after:
        verifications = after["spec_verifications"] - before.get("spec_verifications", 0)
        accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
        return accepted / verifications if verifications > 0 else None
    return after.get("avg_spec_accept_length")


def _request_input(settings: BenchSettings, row: DatasetRow, output_len: int | None = None) -> RequestInput:
    return RequestInput(
        prompt=row.prompt, prompt_len=row.prompt_len, output_len=output_len or row.output_len,
        model=settings.model, api_url=settings.api_url, stream=settings.stream, ignore_eos=settings.ignore_eos,
        extra_body=settings.extra_request_body,
    )


async def _warm_up(client: httpx.AsyncClient, settings: BenchSettings, first: DatasetRow) -> None:
    if settings.warmup_requests <= 0:
        return
    send = request_func(settings.backend)
    inp = _request_input(settings, first, min(first.output_len, WARMUP_OUTPUT_LEN))
    outputs = await asyncio.gather(*(send(client, inp) for _ in range(settings.warmup_requests)))
    if not any(o.success for o in outputs):
        raise RuntimeError(f"warm-up failed; check the benchmark's flags. Error: {outputs[0].error.strip()}")


async def _send_all(client: httpx.AsyncClient, settings: BenchSettings, rows: Sequence[DatasetRow],
                    bar: tqdm | None) -> list[RequestRecord]:
    send = request_func(settings.backend)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    arrivals = random.Random(settings.seed)

    async def one(row: DatasetRow) -> RequestRecord:
        if slots is None:
            out = await send(client, _request_input(settings, row))
        else:
            async with slots:
                out = await send(client, _request_input(settings, row))
        if bar is not None:
            bar.update(1)
        return out

    return await start_spaced(list(rows), one, settings.request_rate, arrivals)


async def flush_cache(client: httpx.AsyncClient, base_url: str) -> None:
    """Empty the server's prefix cache (SGLang's and eaglesrv's /flush_cache); a server without one is told."""
    try:
        response = await client.post(base_url + "/flush_cache", timeout=60.0)
        if response.status_code == 200:
            return
        problem = f"HTTP {response.status_code}"
    except httpx.HTTPError as e:
        problem = repr(e)
    print(f"Warning: /flush_cache failed ({problem}); the run starts with whatever the server has cached")


Workload = Sequence[DatasetRow] | Sequence[ConversationRow]


async def benchmark(settings: BenchSettings, rows: Workload, tokenizer: Any,
                    transport: httpx.AsyncBaseTransport | None = None) -> BenchResult:
    """Warm up, run every row (or conversation) once, and measure; `transport` lets tests answer
    without a server."""
    if not rows:
        raise ValueError("no requests to send")
    multiturn = isinstance(rows[0], ConversationRow)
    async with _new_client(settings, transport) as client:
        await _warm_up(client, settings, first_turn_row(rows[0], tokenizer, settings.backend) if multiturn else rows[0])
        if settings.flush_cache:
            await flush_cache(client, settings.base_url)
        before = await server_info(client, settings.base_url)
        total = sum(r.num_turns for r in rows) if multiturn else len(rows)
        bar = tqdm(total=total, desc=settings.progress_label, disable=not settings.show_progress)
        started = time.perf_counter()
        try:
            if multiturn:
                sent = await replay_conversations(client, settings, rows, tokenizer, bar)
            else:
                outputs, turns = await _send_all(client, settings, rows, bar), None
        finally:
            bar.close()
        duration = time.perf_counter() - started
        after = await server_info(client, settings.base_url)
    if multiturn:
        outputs, turns = count_prompt_tokens(sent, tokenizer)
    metrics = compute_metrics(outputs, duration, tokenizer)
    return BenchResult(settings, duration, metrics, accept_length_between(before, after), outputs, turns)


def run_benchmark(settings: BenchSettings, rows: Workload, tokenizer: Any) -> BenchResult:
    raise_open_file_limit()
    return asyncio.run(benchmark(settings, rows, tokenizer))
