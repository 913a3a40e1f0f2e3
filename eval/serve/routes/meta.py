"""``GET /health``, ``GET /v1/models`` (the model and its LoRA adapters) and ``GET /metrics`` (Prometheus's text format, written by
`prometheus_client`: requests by route and status, tokens in and out, decode steps, batch size, queue depth, prefix-cache hits and
hit rate, bytes per tier, and ``k3jax_speculation_*`` when the engine speculates)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..server import Server


def register(app: FastAPI, server: Server) -> None:
    served = server.served

    @app.get("/health")
    async def health():
        """``ok``, or ``degraded`` with the reasons (a disk tier that refused its latest spill):
        the server still answers what fits in memory."""
        disk = server.engine.store.disk_failure
        return {"status": "ok"} if disk is None else {"status": "degraded", "reasons": [disk]}

    @app.get("/v1/models")
    async def models():
        """The base model, then each loaded LoRA adapter (its ``parent`` the base, as vLLM lists them)."""
        base = {"id": served.name, "object": "model", "created": int(server.started), "owned_by": "k3jax",
                "root": str(served.run.run_dir), "parent": None, "max_model_len": served.max_model_len}
        adapters = [] if served.adapters is None else list(served.adapters.adapters.values())
        return {"object": "list", "data": [base] + [
            {**base, "id": adapter.name, "root": adapter.path, "parent": served.name} for adapter in adapters]}

    @app.get("/metrics")
    async def metrics():
        stats, speculation = await server.on_engine(lambda store: (store.stats(), server.engine.speculation()))
        return PlainTextResponse(prometheus_text(server, stats, speculation), media_type=CONTENT_TYPE_LATEST)


def prometheus_text(server: Server, stats: dict, speculation: dict | None = None) -> str:
    """The server's counters and gauges, and its latency histograms (`eval.serve.latency`), in
    Prometheus's text format through `prometheus_client`; ``speculation`` (the engine's
    `Engine.speculation`) adds the ``k3jax_speculation_*`` ones, which a server without speculative
    decoding leaves out."""
    engine = server.engine
    families = []

    def metric(name, kind, help_text, samples):
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        labels = sorted({key for sample_labels, _ in samples for key in sample_labels})
        family = family_type(f"k3jax_{name}", help_text, labels=labels)
        for sample_labels, value in samples:
            family.add_metric([str(sample_labels[key]) for key in labels], value)
        families.append(family)

    metric("requests_total", "counter", "HTTP requests by route and status",
           [({"route": route, "status": status}, count) for (route, status), count in sorted(server.requests.items())])
    metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests", [({}, engine.counters["prompt_tokens"])])
    metric("generation_tokens_total", "counter", "tokens generated (/ decode steps: the mean tokens per step)", [({}, engine.counters["generation_tokens"])])
    metric("decode_steps_total", "counter", "engine steps (a batched decode step or speculative round)", [({}, engine.counters["decode_steps"])])
    metric("request_timeouts_total", "counter", "requests past their deadline", [({}, engine.counters["timeouts"])])
    metric("batch_size", "gauge", "sequences in the latest decode step", [({}, engine.last_batch)])
    metric("queue_depth", "gauge", "requests waiting to be admitted", [({}, engine.queue_depth)])
    hits, misses = stats["prefix_hits"], stats["prefix_misses"]
    metric("prefix_cache_hits_total", "counter", "prefills that resumed from a cached prefix", [({}, hits)])
    metric("prefix_cache_misses_total", "counter", "prefills that found no cached prefix", [({}, misses)])
    metric("prefix_cache_hit_rate", "gauge", "hits / (hits + misses)", [({}, hits / (hits + misses) if hits + misses else 0.0)])
    metric("prefill_tokens_total", "counter", "prompt tokens prefilled", [({}, stats["prefill_tokens"])])
    metric("prefix_tokens_reused_total", "counter", "prompt tokens not prefilled thanks to the cache",
           [({}, stats["prefix_tokens_reused"])])
    metric("tier_bytes", "gauge", "bytes of session state per tier",
           [({"tier": tier}, stats[f"{tier}_bytes"]) for tier in ("device", "host", "disk")])
    metric("sessions", "gauge", "open sessions (running requests and stored responses)", [({}, stats["sessions"])])
    metric("stored_responses", "gauge", "responses kept for previous_response_id", [({}, len(server.responses.items))])
    metric("stored_responses_evicted_total", "counter", "stored responses evicted past --max-stored-responses",
           [({}, server.responses.evicted)])
    if speculation is not None:
        for name, kind, key, help_text in SPECULATION_METRICS:
            metric(f"speculation_{name}", kind, help_text, [({}, speculation[key])])
    registry = CollectorRegistry()
    registry.register(Snapshot(families))
    return generate_latest(registry).decode() + server.latency.text()


class Snapshot(Collector):
    """Metric families read once (the engine's counters and the store's stats of one request)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


SPECULATION_METRICS = [      # (name after k3jax_speculation_, kind, `SpeculationStats.as_dict` key, help)
    ("rounds_total", "counter", "rounds", "speculative rounds, one per sequence and engine step"),
    ("drafted_tokens_total", "counter", "drafted", "draft tokens proposed"),
    ("accepted_tokens_total", "counter", "accepted", "draft tokens accepted"),
    ("acceptance_rate", "gauge", "acceptance_rate", "accepted / drafted"),
    ("mean_accepted_length", "gauge", "mean_accepted_length", "accepted draft tokens per round"),
    ("draft_seconds_total", "counter", "draft_seconds", "seconds spent drafting"),
    ("verify_seconds_total", "counter", "verify_seconds", "seconds spent verifying, rolling back and replaying"),
]
