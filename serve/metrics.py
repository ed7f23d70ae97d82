"""`/metrics`: Prometheus text format through prometheus_client, read from the engine loop at scrape time.

The loop's totals are exposed by a collector (no copying on the hot path); the HTTP layer adds its
own request counter and latency histograms.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specrt.serve.loop import EngineLoop

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _LoopCollector:
    """Engine-side metrics, computed from the loop's running totals on each scrape."""

    def __init__(self, loop: EngineLoop, model: str) -> None:
        self.loop, self.model = loop, model

    def collect(self):
        s, m = self.loop.stats, [self.model]

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(m, value)
            return c

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(m, value)
            return g

        yield counter("specrt_requests", "Requests the engine accepted.", s.requests)
        yield counter("specrt_requests_aborted", "Requests aborted (client disconnects, cancellations).", s.aborted)
        yield counter("specrt_prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("specrt_generation_tokens", "Tokens generated.", s.generated_tokens)
        yield counter("specrt_engine_steps", "Engine steps (a decode step or a draft/verify round).", s.steps)
        yield counter("specrt_spec_rounds", "Per-request rounds (AR: tokens).", s.rounds)
        yield counter("specrt_draft_seconds", "Time spent drafting.", s.draft_s)
        yield counter("specrt_verify_seconds", "Time spent verifying.", s.verify_s)
        yield counter("specrt_step_seconds", "Time spent in engine steps (prefill included).", s.step_s)
        yield gauge("specrt_queue_depth", "Requests waiting for a slot.", self.loop.queue_depth)
        yield gauge("specrt_active_slots", "Slots holding a request.", self.loop.active)
        yield gauge("specrt_slots", "Slots the engine has.", len(self.loop.engine.slots))
        yield gauge("specrt_tau", "Mean tokens committed per round since start (1 for AR).", s.tau)
        acc = GaugeMetricFamily("specrt_draft_acceptance", "P(draft position k accepted | verified), since start.",
                                labels=["model", "position"])
        for k, (tried, ok) in enumerate(zip(s.proposed_at, s.accepted_at), start=1):
            acc.add_metric([self.model, str(k)], ok / tried if tried else 0.0)
        yield acc


class Metrics:
    """The server's registry: the loop collector plus HTTP counters and latency histograms."""

    def __init__(self, loop: EngineLoop, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LoopCollector(loop, model))
        self.http = Counter("specrt_http_requests", "HTTP requests by endpoint and status.",
                            ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("specrt_time_to_first_token_seconds", "From request to its first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("specrt_request_latency_seconds", "From request to its last token.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
