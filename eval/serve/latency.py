"""Request latencies as Prometheus histograms (`prometheus_client`, in the server's own registry):

    k3jax_time_to_first_token_seconds   a request's submission to its first token's event
    k3jax_inter_token_latency_seconds   between consecutive token events of one choice
    k3jax_e2e_request_latency_seconds   a request's submission to its result (or error)

measured on the HTTP side where each engine event arrives (what a client sees, less the network).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)


class Latency:
    """The three histograms; `watch` follows one request."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.first_token = Histogram("k3jax_time_to_first_token_seconds", "submission to the first token",
                                     buckets=BUCKETS, registry=self.registry)
        self.inter_token = Histogram("k3jax_inter_token_latency_seconds", "between a choice's consecutive tokens",
                                     buckets=BUCKETS, registry=self.registry)
        self.end_to_end = Histogram("k3jax_e2e_request_latency_seconds", "submission to the result",
                                    buckets=BUCKETS, registry=self.registry)

    def watch(self) -> "Watch":
        return Watch(self)

    def text(self) -> str:
        """The histograms in Prometheus's text format."""
        return generate_latest(self.registry).decode()


class Watch:
    """One request's clock: `on` each engine event it receives, in order."""

    def __init__(self, latency: Latency):
        self.latency, self.start = latency, time.monotonic()
        self.last: dict[int, float] = {}          # choice -> its latest token's time
        self.first = True

    def on(self, event: tuple) -> None:
        now = time.monotonic()
        if event[0] == "token":
            index = event[1]
            if self.first:
                self.latency.first_token.observe(now - self.start)
                self.first = False
            elif index in self.last:
                self.latency.inter_token.observe(now - self.last[index])
            self.last[index] = now
        elif event[0] in ("result", "error"):
            self.latency.end_to_end.observe(now - self.start)
