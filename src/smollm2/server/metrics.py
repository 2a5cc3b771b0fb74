"""What GET /metrics tells Prometheus: requests answered by route and status, tokens in and out, the queue and the
rows in flight, the prefix cache's hits, and the time to each request's first token and between its tokens.

The metrics live in a registry of the app's own, so two apps in one process (tests) count apart. Token times are
taken by the scheduler's thread as each token is sampled (Request.token_times) and observed once a request ends,
finished or cancelled, so the scheduler's step does no more than append a number.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds: a 135M model's decoding step is milliseconds, a long prompt's prefill seconds.
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, schedulers: list):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("smollm2_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("smollm2_prompt_tokens", "Prompt tokens of the requests ended",
                                     registry=registry)
        self.generated_tokens = Counter("smollm2_generated_tokens", "Tokens generated for the requests ended",
                                        registry=registry)
        Gauge("smollm2_requests_waiting", "Requests queued for a free row", registry=registry).set_function(
            lambda: sum(scheduler.load()["waiting"] for scheduler in schedulers))
        Gauge("smollm2_requests_running", "Requests in flight, a row of the batch each", registry=registry
              ).set_function(lambda: sum(scheduler.load()["active"] for scheduler in schedulers))
        registry.register(PrefixCacheCounts([s.prefix_cache for s in schedulers if s.prefix_cache is not None]))
        registry.register(DecodingCounts([s.engine for s in schedulers]))
        self.time_to_first_token = Histogram("smollm2_time_to_first_token_seconds",
                                             "From a request's arrival to its first token", buckets=TOKEN_BUCKETS,
                                             registry=registry)
        self.inter_token = Histogram("smollm2_inter_token_seconds", "Between two tokens of one request",
                                     buckets=TOKEN_BUCKETS, registry=registry)

    def ended(self, request) -> None:
        """Count a request that ended (finished, cancelled or failed): its tokens and their times."""
        times = request.token_times
        self.prompt_tokens.inc(len(request.sequence.prompt))
        self.generated_tokens.inc(len(request.sequence.tokens))
        if times:
            self.time_to_first_token.observe(times[0] - request.submitted)
        for before, after in zip(times, times[1:]):
            self.inter_token.observe(after - before)

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
                                  ("speculation_kept_tokens", "Guessed tokens the model kept", "kept")):
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
