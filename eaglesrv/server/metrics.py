"""Prometheus metrics, in a registry owned by the server (no process-wide default registry).

Counters and latency histograms are recorded in the API process as tokens stream out;
scheduler gauges (running, waiting, KV pages) are refreshed from an engine snapshot at
each scrape. Names follow SGLang's, with the `eaglesrv:` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from eaglesrv.engine.protocol import EngineStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ("model_name", *extra), registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ("model_name",), registry=reg).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ("model_name",), buckets=buckets, registry=reg).labels(**label)

        self._model = model_name
        self._requests = counter("eaglesrv:num_requests", "Finished engine requests, by finish reason.",
                                 ("finish_reason",))
        self.prompt_tokens = counter("eaglesrv:prompt_tokens", "Prompt tokens of finished requests.").labels(**label)
        self.generation_tokens = counter("eaglesrv:generation_tokens", "Generated tokens.").labels(**label)
        self.num_running = gauge("eaglesrv:num_running_reqs", "Requests holding KV pages (prefilling or decoding).")
        self.num_waiting = gauge("eaglesrv:num_queue_reqs", "Requests waiting for admission.")
        self.kv_pages_used = gauge("eaglesrv:kv_pages_used", "KV-cache pages in use.")
        self.kv_pages_free = gauge("eaglesrv:kv_pages_free", "KV-cache pages free.")
        self.kv_pages_total = gauge("eaglesrv:kv_pages_total", "KV-cache pages in the pool.")
        self.token_usage = gauge("eaglesrv:token_usage", "Fraction of the KV pool running requests use (cached "
                                 "pages nobody uses count as free).")
        self.cached_pages = gauge("eaglesrv:prefix_cache_pages", "KV pages the prefix cache holds (in use or not).")
        self.cache_hit_rate = gauge("eaglesrv:cache_hit_rate", "Prompt tokens found in the prefix cache, as a "
                                    "fraction of prompt tokens admitted.")
        self.cache_hit_tokens = gauge("eaglesrv:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.")
        self.cache_evicted = gauge("eaglesrv:prefix_cache_evicted_pages", "Cached pages evicted to make room.")
        self.ttft = histogram("eaglesrv:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("eaglesrv:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("eaglesrv:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _E2E_BUCKETS)
        self._speculation = _SpeculationCollector(model_name)
        reg.register(self._speculation)

    def request_finished(self, finish_reason: str, num_prompt_tokens: int, latency_s: float) -> None:
        self._requests.labels(model_name=self._model, finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.e2e.observe(latency_s)

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_free.set(stats.kv_pages_free)
        self.kv_pages_total.set(stats.kv_pages_total)
        self.token_usage.set(stats.token_usage)
        cache = stats.prefix_cache
        self.cached_pages.set(cache.get("prefix_cache_pages", 0))
        self.cache_hit_rate.set(cache.get("prefix_cache_hit_rate", 0.0))
        self.cache_hit_tokens.set(cache.get("prefix_cache_hit_tokens", 0))
        self.cache_evicted.set(cache.get("prefix_cache_evicted_pages", 0))
        self._speculation.snapshot = stats.speculation

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpeculationCollector:
    """The engine's speculation counters as of the last scrape; absent without speculation.

    The engine keeps the running totals, so they are exported as they are (a custom
    collector) rather than re-counted here.
    """

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self.snapshot: dict | None = None

    def collect(self):
        spec = self.snapshot
        if spec is None:
            return
        counters = (
            ("eaglesrv:spec_verifications", "Verification passes (one per request per speculative step).",
             "spec_verifications"),
            ("eaglesrv:spec_accepted_tokens", "Tokens added by verification, bonus tokens included.",
             "spec_accepted_tokens"),
            ("eaglesrv:spec_draft_passes", "Draft-model forward passes.", "spec_draft_passes"),
        )
        for name, doc, key in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(spec.get(key, 0)))
            yield family
        accept = GaugeMetricFamily("eaglesrv:spec_accept_length", "Average tokens per verification (SGLang's accept "
                                   "length).", labels=["model_name"])
        accept.add_metric([self._model], float(spec.get("avg_spec_accept_length", 0.0)))
        yield accept
        by_depth = GaugeMetricFamily("eaglesrv:spec_acceptance_rate", "P(draft depth d kept | depth d-1 kept).",
                                     labels=["model_name", "depth"])
        for depth, rate in enumerate(spec.get("spec_acceptance_by_depth", []), start=1):
            by_depth.add_metric([self._model, str(depth)], float(rate))
        yield by_depth
        if spec.get("spec_adaptive"):
            yield from self._adaptive(spec)

    def _adaptive(self, spec: dict):
        """--speculative-adaptive: the mode the last step chose, and steps per kind."""
        mode = GaugeMetricFamily("eaglesrv:spec_mode", "Tree of the last step (0s: plain decoding), and how many "
                                 "requests used it.", labels=["model_name", "knob"])
        for knob, key in (("num_steps", "spec_mode_num_steps"), ("eagle_topk", "spec_mode_topk"),
                          ("num_draft_tokens", "spec_mode_draft_tokens"), ("requests", "spec_mode_requests")):
            mode.add_metric([self._model, knob], float(spec.get(key, 0)))
        yield mode
        steps = CounterMetricFamily("eaglesrv:spec_adaptive_steps", "Engine steps by the mode the policy chose.",
                                    labels=["model_name", "mode"])
        for kind in ("plain", "speculative"):
            steps.add_metric([self._model, kind], float(spec.get(f"spec_steps_{kind}", 0)))
        yield steps
