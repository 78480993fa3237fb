"""The server's Prometheus metrics: its own requests, and every stage as the gateway last heard
from it (read at each scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


class StageCollector:
    """Per-stage gauges and speculative decoding counters from the gateway's latest Status."""

    def __init__(self):
        self.status = None

    def collect(self):
        stages = self.status.stages if self.status is not None else []
        gauges = {
            "up": ("specsot_stage_up", "1 if the gateway heard from the stage within its deadline"),
            "inflight": ("specsot_stage_requests", "Requests the stage holds"),
            "slots": ("specsot_stage_cache_slots", "KV cache slots of a device stage"),
            "slots_used": ("specsot_stage_cache_slots_used", "KV cache slots decoding now"),
            "rss_mb": ("specsot_stage_resident_memory_bytes", "Resident memory of the stage process"),
            "prefix_bytes": ("specsot_prefix_cache_bytes", "Bytes held by the stage's prefix store"),
        }
        counters = {
            "drafts": ("specsot_spec_drafts", "Sequence-steps verified by speculative decoding"),
            "draft_tokens": ("specsot_spec_draft_tokens", "Draft tokens verified"),
            "accepted_tokens": ("specsot_spec_accepted_tokens", "Draft tokens accepted"),
            "prefix_lookups": ("specsot_prefix_cache_lookups", "Prompts looked up in the prefix store"),
            "prefix_hits": ("specsot_prefix_cache_hits", "Prompts that started from a stored beginning"),
            "prefix_tokens": ("specsot_prefix_cache_reused_tokens", "Prompt tokens taken from the prefix store"),
            "shipped_tokens": ("specsot_kv_shipped_tokens", "Prompt tokens whose KV another device sent instead of recomputing"),
        }
        for key, (name, doc) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["stage", "kind"])
            for s in stages:
                value = float(s.get(key, 0)) * (2**20 if key == "rss_mb" else 1)
                family.add_metric([s["stage"], s["kind"]], value)
            yield family
        for key, (name, doc) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["stage"])
            for s in stages:
                if s.get("slots"):
                    family.add_metric([s["stage"]], float(s.get(key, 0)))
            yield family


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specsot_requests", "Requests by route and how they ended", ["route", "status"], registry=r)
        self.latency = Histogram("specsot_request_seconds", "Time to the whole answer", buckets=LATENCY, registry=r)
        self.ttft = Histogram("specsot_time_to_first_token_seconds", "Time to the first answer text (streamed)",
                              buckets=LATENCY, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("specsot_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("specsot_completion_tokens", "Tokens written, every phase", registry=r)
        self.queue = Gauge("specsot_queue_depth", "Requests waiting for a place (beyond --max-concurrency)", registry=r)
        self.running = Gauge("specsot_requests_running", "Requests in the pipeline now", registry=r)
        self.routed = Counter("specsot_sot_routed", "Answers the router sent the plan-and-expand way", registry=r)
        self.planned = Counter("specsot_sot_planned", "Answers made from a plan of points", registry=r)
        self.fell_back = Counter("specsot_sot_fell_back", "Routed answers whose skeleton was no plan (answered directly)",
                                 registry=r)  # fmt: skip
        self.points = Counter("specsot_sot_points", "Points expanded", registry=r)
        self.stages = StageCollector()
        r.register(self.stages)

    def answered(self, answer, usage: dict) -> None:
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        if answer.mode == "sot":
            self.routed.inc()
            self.planned.inc()
            self.points.inc(len(answer.points))
        elif answer.reason.startswith("skeleton says direct"):
            self.routed.inc()
            self.fell_back.inc()
