"""Prometheus metrics of the HTTP endpoint, plus what the routers' telemetry says.

Request-level series are observed by the ingress as requests run; expert-level series
(routed tokens per worker, drops, balancedness) are read from the routers at scrape time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from raymoe.moe.balance_metrics import balancedness

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServingMetrics:
    def __init__(self, slots_per_worker: int):
        self.slots_per_worker = slots_per_worker
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("raymoe_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("raymoe_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("raymoe_inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("raymoe_e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("raymoe_prompt_tokens", "Prompt tokens processed", registry=r)
        self.output_tokens = Counter("raymoe_generation_tokens", "Output tokens generated", registry=r)
        self.routed = Gauge("raymoe_worker_routed_tokens", "Expert assignments routed to each worker (all layers, since start)", ["worker"], registry=r)
        self.dropped = Gauge("raymoe_dropped_tokens", "Expert assignments dropped by the capacity policy (since start)", registry=r)
        self.balance = Gauge("raymoe_balancedness", "Mean over MoE layers of mean/max worker load (1 = perfect)", registry=r)
        self.window_balance = Gauge("raymoe_window_balancedness", "Controller's window balancedness by statistic over layers", ["stat"], registry=r)
        self.rebalances = Gauge("raymoe_rebalances", "Rebalances carried out since start", registry=r)
        self.migration_seconds = Gauge("raymoe_migration_seconds", "Seconds spent migrating experts since start", registry=r)
        self.running = Gauge("raymoe_num_requests_running", "Sequences in the routers' running batches", registry=r)
        self.waiting = Gauge("raymoe_num_requests_waiting", "Sequences waiting for a place in a batch", registry=r)
        self.sampled = Gauge("raymoe_router_generated_tokens", "Tokens the routers sampled since start, aborted requests' included", registry=r)
        self.bytes_moved = Gauge("raymoe_migration_bytes", "Expert weight bytes copied by rebalances since start", registry=r)

    def render(self, telemetry: list[dict[str, Any]], controller: dict[str, Any] | None = None) -> bytes:
        if telemetry:
            slot_tokens = np.sum([np.asarray(t["slot_tokens"], dtype=np.float64) for t in telemetry], axis=0)  # [L, P]
            worker_load = slot_tokens.reshape(slot_tokens.shape[0], -1, self.slots_per_worker).sum(axis=2)  # [L, W]
            for worker, tokens in enumerate(worker_load.sum(axis=0)):
                self.routed.labels(worker=str(worker)).set(tokens)
            self.dropped.set(sum(t["dropped"] for t in telemetry))
            self.running.set(sum(t.get("requests_running", 0) for t in telemetry))
            self.waiting.set(sum(t.get("requests_waiting", 0) for t in telemetry))
            self.sampled.set(sum(t.get("generated_tokens", 0) for t in telemetry))
            self.balance.set(balancedness(worker_load))
        if controller is not None:
            self.window_balance.labels(stat="avg").set(controller["balancedness"])
            self.window_balance.labels(stat="min").set(controller["balancedness_min"])
            self.rebalances.set(controller["rebalances"])
            self.migration_seconds.set(controller["migration_seconds"])
            self.bytes_moved.set(controller["bytes_moved"])
        return generate_latest(self.registry)
