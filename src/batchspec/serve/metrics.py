"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _EngineCollector:
    """Live values read from the worker and the engine's counters at scrape time."""

    def __init__(self, worker, llm):
        self.worker, self.llm = worker, llm

    def collect(self):
        w, s = self.worker, self.llm.stats
        g = GaugeMetricFamily("batchspec_queue_length", "Requests accepted that hold no row of the running batch yet")
        g.add_metric([], w.queued)
        yield g
        g = GaugeMetricFamily("batchspec_running_rows", "Rows in the engine's running batch")
        g.add_metric([], w.running)
        yield g
        g = GaugeMetricFamily("batchspec_requests_in_flight", "Requests accepted and not finished")
        g.add_metric([], w.in_flight)
        yield g
        g = GaugeMetricFamily("batchspec_engine_alive", "1 while the engine thread runs")
        g.add_metric([], 1.0 if w.alive else 0.0)
        yield g
        for name, doc, value in (
            ("batchspec_generated_tokens", "Tokens the engine emitted", s.generated),
            ("batchspec_rounds", "Engine rounds (one target forward each)", s.rounds),
            ("batchspec_drafted_tokens", "Draft tokens proposed", s.drafted),
            ("batchspec_accepted_tokens", "Draft tokens accepted", s.accepted),
            ("batchspec_forced_drafted_tokens", "Draft tokens a grammar forced (part of the drafted ones)",
             s.forced_drafted),
            ("batchspec_forced_accepted_tokens", "Forced draft tokens accepted", s.forced_accepted),
            ("batchspec_engine_errors", "Engine steps that raised", w.errors),
            ("batchspec_request_restarts", "Requests started again after a failed step", w.restarts),
            ("batchspec_prefix_cache_hits", "Prompts whose prefill started from cached blocks", s.prefix_hits),
            ("batchspec_prefix_cache_tokens", "Prompt tokens taken from cached blocks, not computed",
             s.prefix_tokens),
            ("batchspec_prefix_cache_evictions", "Cached prompt blocks dropped for room", s.prefix_evictions),
            ("batchspec_prefill_chunks", "Chunks of long prompts prefilled ahead while rows ran", s.prefill_chunks),
            ("batchspec_kept_first", "Waiting requests with kept prompts admitted ahead of ones that cost a prefill",
             s.kept_first),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        for name, doc, value in (
            ("batchspec_kv_bytes_used", "Bytes the running rows' keys and values take (rows x the longest row's slots, "
             "target and draft caches)", s.kv_bytes_used),
            ("batchspec_kv_bytes_peak", "Most bytes the running rows' keys and values took", s.kv_bytes_peak),
            ("batchspec_kv_bytes_held", "Bytes the KV cache buffers hold (spare room included)", s.kv_bytes_held),
            ("batchspec_kv_bytes_visible", "Bytes the running rows' cached tokens need", s.kv_bytes_visible),
            ("batchspec_kv_bytes_capacity", "KV memory budget that admission keeps the running rows in",
             s.kv_bytes_budget),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        g = GaugeMetricFamily("batchspec_mean_accepted_length",
                              "Tokens emitted per row per round, bonus token included (1.0: no speculation)")
        g.add_metric([], s.mean_accepted_length)
        yield g
        c = CounterMetricFamily("batchspec_round_decisions", "Engine rounds by what decided their draft budget "
                                "(draft, fixed, probe, not-worth-it, dry, no-room, no-drafter)", labels=["reason"])
        for reason, n in sorted(s.decisions.items()):
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("batchspec_round_kinds", "Drafting rounds by kind (the head's copy / head rounds)",
                                labels=["kind"])
        for kind, n in sorted(s.kinds.items()):
            c.add_metric([kind], n)
        yield c
        c = CounterMetricFamily("batchspec_requests_finished", "Requests finished, by reason", labels=["reason"])
        for reason, n in sorted(w.finished.items()):
            c.add_metric([reason], n)
        yield c


class ServerMetrics:
    def __init__(self, worker, llm):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("batchspec_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("batchspec_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.ttft = Histogram("batchspec_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("batchspec_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("batchspec_e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("batchspec_queue_time_seconds", "Arrival to joining the engine",
                                    buckets=TTFT_BUCKETS, registry=r)
        r.register(_EngineCollector(worker, llm))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
