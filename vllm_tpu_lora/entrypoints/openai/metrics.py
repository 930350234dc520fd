"""Prometheus metrics: engine state (read from AsyncLLMEngine.stats() at scrape time) and
per-request counters and latency histograms (observed as each request's stream ends).

Names follow vLLM's (`vllm:...`) where vLLM has the metric; the rest are `vllm_tpu_lora:`.
A registry of its own per server, so several servers in one process don't collide.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm_tpu_lora.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# stats() key -> (metric name, help, kind)
_ENGINE_METRICS = {
    "num_running": ("vllm:num_requests_running", "Sequences running on the engine.", "gauge"),
    "num_waiting": ("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", "gauge"),
    "lora_slots_in_use": ("vllm_tpu_lora:lora_slots_in_use",
                          "Device LoRA slots holding an adapter.", "gauge"),
    "lora_slot_loads": ("vllm_tpu_lora:lora_slot_loads",
                        "Adapter writes into device slots.", "counter"),
    "num_free_kv_blocks": ("vllm_tpu_lora:num_free_kv_blocks", "Free KV cache blocks.", "gauge"),
    "num_unfinished_requests": ("vllm_tpu_lora:num_unfinished_requests",
                                "Requests the engine holds (waiting or running).", "gauge"),
    "num_open_streams": ("vllm_tpu_lora:num_open_streams",
                         "Request streams the server holds open.", "gauge"),
    "num_preemptions": ("vllm:num_preemptions", "Preemptions by recompute.", "counter"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",
                             "Prefix cache queries, in terms of number of queried tokens.",
                             "counter"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens.", "counter"),
    "num_cached_kv_blocks": ("vllm_tpu_lora:num_cached_kv_blocks",
                             "KV blocks registered in the prefix cache (in use or free).", "gauge"),
    "num_steps": ("vllm_tpu_lora:engine_steps", "Engine steps run.", "counter"),
    "num_graphs": ("vllm_tpu_lora:precompiled_graphs", "Graphs compiled at warm-up.", "gauge"),
    "warmup_seconds": ("vllm_tpu_lora:warmup_seconds", "Seconds spent precompiling.", "gauge"),
    "compilations_after_warmup": ("vllm_tpu_lora:compilations_after_warmup",
                                  "XLA compilations after warm-up (should stay 0).", "gauge"),
}


# stats()["loras"][name] key -> (metric name, help, kind), one series per adapter.
_ADAPTER_METRICS = {
    "host_loads": ("vllm_tpu_lora:lora_host_loads", "Adapter reads from disk into host memory.",
                   "counter"),
    "host_evictions": ("vllm_tpu_lora:lora_host_evictions",
                       "Adapter host copies dropped from the host cache (LRU).", "counter"),
    "slot_loads": ("vllm_tpu_lora:lora_adapter_slot_loads",
                   "Adapter writes into a device slot.", "counter"),
    "slot_evictions": ("vllm_tpu_lora:lora_slot_evictions",
                       "Times the adapter was evicted from its device slot.", "counter"),
    "load_failures": ("vllm_tpu_lora:lora_load_failures",
                      "Background reads of the adapter that failed.", "counter"),
    "on_device": ("vllm_tpu_lora:lora_on_device", "1 if the adapter holds a device slot.",
                  "gauge"),
    "in_host_cache": ("vllm_tpu_lora:lora_in_host_cache",
                      "1 if the adapter's host copy is in memory.", "gauge"),
    "prefix_cache_queries": ("vllm_tpu_lora:lora_prefix_cache_queries",
                             "Prompt tokens of the adapter's requests looked up in the prefix "
                             "cache.", "counter"),
    "prefix_cache_hits": ("vllm_tpu_lora:lora_prefix_cache_hits",
                          "Of those, tokens found cached (under this adapter's weights).",
                          "counter"),
    "running": ("vllm_tpu_lora:lora_requests_running",
                "Running sequences using the adapter.", "gauge"),
    "waiting": ("vllm_tpu_lora:lora_requests_waiting",
                "Waiting sequences (for a slot or the adapter's read) using the adapter.",
                "gauge"),
}


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for key, (name, doc, kind) in _ENGINE_METRICS.items():
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=float(value))
        loras = stats.get("loras")
        if loras is not None:
            yield from _adapter_families(loras, stats)


def _adapter_families(loras: dict, stats: dict):
    for key, (name, doc, kind) in _ADAPTER_METRICS.items():
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, doc, labels=["lora_name"])
        for lora_name, a in sorted(loras.items()):
            family.add_metric([lora_name], float(a[key]))
        yield family
    # vLLM's info gauge (what llm-d routes on): the adapters running and waiting, as labels.
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "running_lora_adapters",
                                     "waiting_lora_adapters"])
    running = ",".join(n for n, a in sorted(loras.items()) if a["running"])
    waiting = ",".join(n for n, a in sorted(loras.items()) if a["waiting"])
    info.add_metric([str(stats.get("max_loras", "")), running, waiting], time.time())
    yield info


# resolver_stats() key -> (metric name, help), one series per resolver ("0:S3Resolver":
# its position and kind, never its URI: /metrics answers without the API key).
_RESOLVER_METRICS = {
    "lookups": ("vllm_tpu_lora:lora_resolver_lookups", "Adapter names looked up."),
    "hits": ("vllm_tpu_lora:lora_resolver_hits", "Lookups that found the adapter."),
    "download_bytes": ("vllm_tpu_lora:lora_resolver_download_bytes", "Bytes downloaded."),
    "download_seconds": ("vllm_tpu_lora:lora_resolver_download_seconds",
                         "Seconds spent downloading."),
}


class _ResolverCollector:
    def __init__(self, resolver_stats) -> None:
        self.resolver_stats = resolver_stats

    def collect(self):
        rows = self.resolver_stats()
        for key, (name, doc) in _RESOLVER_METRICS.items():
            family = CounterMetricFamily(name, doc, labels=["resolver"])
            for row in rows:
                family.add_metric([row["resolver"]], float(row[key]))
            yield family


class ServerMetrics:
    def __init__(self, engine, resolver_stats=None) -> None:
        """resolver_stats: OpenAIServingModels.resolver_stats, when resolvers are set."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        if resolver_stats is not None:
            self.registry.register(_ResolverCollector(resolver_stats))
        labels = ["model_name"]
        kw = dict(registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS, **kw)
        self.requests = Counter("vllm:request_success", "Finished requests per model/adapter.",
                                labels + ["finished_reason"], **kw)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, **kw)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         **kw)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, stream: AsyncIterator[RequestOutput], model_name: str,
                    arrival: float) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, observing TTFT, latency and token counts.
        A stream that ends early (client gone, error) counts as finished_reason="abort"."""
        first_seen, last = False, None
        try:
            async for out in stream:
                if not first_seen and any(o.token_ids for o in out.outputs):
                    first_seen = True
                    self.ttft.labels(model_name).observe(time.monotonic() - arrival)
                last = out
                yield out
        finally:
            self._finish(last, model_name, arrival)

    def _finish(self, last: RequestOutput | None, model_name: str, arrival: float) -> None:
        if last is not None:
            self.prompt_tokens.labels(model_name).inc(len(last.prompt_token_ids))
            self.generation_tokens.labels(model_name).inc(
                sum(len(o.token_ids) for o in last.outputs))
        if last is None or not last.finished:
            self.requests.labels(model_name, "abort").inc()
            return
        self.e2e.labels(model_name).observe(time.monotonic() - arrival)
        self.requests.labels(model_name, last.outputs[0].finish_reason or "abort").inc()
