"""What GET /metrics tells Prometheus: requests answered by route and status, tokens in and out, the queue and the
rows in flight, the prefix cache's hits, and the time to each request's first token and between its tokens.

The same load is also told under vLLM's names (vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:prompt_tokens_total, vllm:generation_tokens_total, and the histograms
vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds with vLLM's buckets), labelled as vLLM labels
them, model_name and engine, one series per model served: what KEDA, KServe and the Gateway API inference
extension's endpoint picker read, unmodified.

The metrics live in a registry of the app's own, so two apps in one process (tests) count apart. Token times are
taken by the engine thread as each token is sampled (Generation.token_times) and observed once a request ends,
finished or cancelled, so the engine thread's step does no more than append a number.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds: a 135M model's decoding step is milliseconds, a long prompt's prefill seconds.
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
# vLLM's own bucket bounds, so that dashboards and SLO rules written for vLLM (le="0.25", ...) read ours alike.
VLLM_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                            20.0, 40.0, 80.0)
VLLM_LABELS = ("model_name", "engine")  # engine: vLLM's index of an engine core; here each model has one, "0"


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engines: dict):
        """engines: the engine thread of each model served, by name."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("smollm2_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("smollm2_prompt_tokens", "Prompt tokens of the requests ended",
                                     registry=registry)
        self.generated_tokens = Counter("smollm2_generated_tokens", "Tokens generated for the requests ended",
                                        registry=registry)
        Gauge("smollm2_requests_waiting", "Requests queued for a free row", registry=registry).set_function(
            lambda: sum(thread.load()["waiting"] for thread in engines.values()))
        Gauge("smollm2_requests_running", "Requests in flight, a row of the batch each", registry=registry
              ).set_function(lambda: sum(thread.load()["active"] for thread in engines.values()))
        registry.register(PrefixCacheCounts([thread.prefix_cache for thread in engines.values()
                                             if thread.prefix_cache is not None]))
        registry.register(DecodingCounts([s.engine for s in engines.values()]))
        registry.register(VllmLoad(engines))
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests ended", VLLM_LABELS,
                                          registry=registry)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for the requests ended",
                                              VLLM_LABELS, registry=registry)
        self.vllm_time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                                  "From a request's arrival to its first token", VLLM_LABELS,
                                                  buckets=VLLM_FIRST_TOKEN_BUCKETS, registry=registry)
        self.vllm_inter_token = Histogram("vllm:inter_token_latency_seconds",
                                          "Between two tokens of one request", VLLM_LABELS,
                                          buckets=VLLM_INTER_TOKEN_BUCKETS, registry=registry)
        for name in engines:  # every series from the start, at 0: a rate() needs the value before the first
            for metric in (self.vllm_prompt_tokens, self.vllm_generation_tokens, self.vllm_time_to_first_token,
                           self.vllm_inter_token):
                metric.labels(name, "0")
        self.time_to_first_token = Histogram("smollm2_time_to_first_token_seconds",
                                             "From a request's arrival to its first token", buckets=TOKEN_BUCKETS,
                                             registry=registry)
        self.inter_token = Histogram("smollm2_inter_token_seconds", "Between two tokens of one request",
                                     buckets=TOKEN_BUCKETS, registry=registry)

    def ended(self, generation, model_name: str) -> None:
        """Count a request of model `model_name` that ended (finished, cancelled or failed): its tokens and their
        times."""
        times, labels = generation.token_times, (model_name, "0")
        for ours, vllm, tokens in ((self.prompt_tokens, self.vllm_prompt_tokens, generation.sequence.prompt),
                                   (self.generated_tokens, self.vllm_generation_tokens, generation.sequence.tokens)):
            ours.inc(len(tokens))
            vllm.labels(*labels).inc(len(tokens))
        if times:
            for histogram in (self.time_to_first_token, self.vllm_time_to_first_token.labels(*labels)):
                histogram.observe(times[0] - generation.submitted)
        for before, after in zip(times, times[1:]):
            for histogram in (self.inter_token, self.vllm_inter_token.labels(*labels)):
                histogram.observe(after - before)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCounts(Collector):
    """The prefix caches' own counts (every model's, added up), read as Prometheus scrapes: nothing to do per
    request. The hit rate is rate(smollm2_prefix_cache_hit_tokens_total) / rate(..._queried_tokens_total)."""

    def __init__(self, caches: list):
        self.caches = caches

    def collect(self):
        yield CounterMetricFamily("smollm2_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                                  "cache", value=sum(cache.looked_up for cache in self.caches))
        yield CounterMetricFamily("smollm2_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache, "
                                  "not prefilled again", value=sum(cache.found for cache in self.caches))
        yield GaugeMetricFamily("smollm2_prefix_cache_bytes", "Memory the prefix cache's keys and values take",
                                value=sum(cache.bytes for cache in self.caches))
        yield CounterMetricFamily("smollm2_prefix_cache_disk_hit_tokens", "Prompt tokens found in the prefix "
                                  "cache's files (--prefix-cache-dir), of those found", value=sum(
                                      cache.from_disk for cache in self.caches))
        yield CounterMetricFamily("smollm2_prefix_cache_disk_refused_files", "Prefix cache files refused (corrupt, "
                                  "or another model's), their chunks computed again", value=sum(
                                      cache.disk.refused for cache in self.caches if cache.disk is not None))


class VllmLoad(Collector):
    """Each model's load under vLLM's gauges, read as Prometheus scrapes: its requests running (holding a cache
    row) and waiting, and the share of its KV cache's slots that rows hold, from 0 to 1."""

    def __init__(self, engines: dict):
        self.engines = engines

    def collect(self):
        families = (GaugeMetricFamily("vllm:num_requests_running", "Requests in flight, a row of the batch each",
                                      labels=VLLM_LABELS),
                    GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued for a free row",
                                      labels=VLLM_LABELS),
                    GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the KV cache's slots rows hold, 0 to 1",
                                      labels=VLLM_LABELS))
        for name, thread in self.engines.items():
            load = thread.load()
            for family, value in zip(families, (load["active"], load["waiting"], thread.engine.kv_cache_usage)):
                family.add_metric([name, "0"], value)
        yield from families


class DecodingCounts(Collector):
    """The engines' decoding passes and what they gave: tokens per pass is rate(smollm2_decoded_tokens_total) /
    rate(smollm2_decoding_passes_total), above 1 with speculation; its acceptance rate is
    rate(smollm2_speculation_kept_tokens_total) / rate(smollm2_speculation_guessed_tokens_total)."""

    def __init__(self, engines: list):
        self.engines = engines

    def collect(self):
        for name, text, field in (("decoding_passes", "Decoding passes over the rows decoding", "passes"),
                                  ("decoded_tokens", "Tokens the decoding passes gave", "decoded"),
                                  ("speculation_guessed_tokens", "Tokens guessed by speculating rows", "guessed"),
                                  ("speculation_kept_tokens", "Guessed tokens the model kept", "kept"),
                                  ("prefilled_tokens", "Prompt tokens the prefill computed, not copied from the "
                                   "prefix cache", "prefilled")):
            yield CounterMetricFamily(f"smollm2_{name}", text, value=sum(getattr(e, field) for e in self.engines))


class CountResponses:
    """ASGI middleware: every response counted by its route (the path template, so ids never make new series;
    "unmatched" for unknown paths) and status, streamed ones included."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
