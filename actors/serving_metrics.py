"""Prometheus metrics of the HTTP endpoint, plus what the routers' telemetry says.

Names follow vLLM's under a ``raymoe:`` prefix where vLLM has the same series
(``raymoe:num_requests_running`` is ``vllm:num_requests_running``), so existing dashboards
and autoscalers work after a prefix swap; raymoe's own expert-parallel series sit beside them
under the same prefix. Every series carries ``model_name`` (the served model name).

Two sources:

- request-level series (latencies, tokens, finished requests, HTTP statuses) are observed by
  this ingress replica as its requests run;
- engine- and expert-level series are read from the routers and the controller at scrape
  time. They are cumulative there (since the router or controller started), so a custom
  collector exposes them as counters, gauges or histograms of those latest values: every
  ingress replica shows the same numbers, and Prometheus sees a reset if a router restarts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from raymoe.engine.latency_histogram import LATENCY_BUCKETS
from raymoe.moe.balance_metrics import balancedness

PREFIX = "raymoe:"


class ServingMetrics:
    def __init__(self, slots_per_worker: int, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, model = self.registry, ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, model, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.requests = Counter(PREFIX + "http_requests", "HTTP requests by endpoint and status (499: the client "
                                "went away)", model + ["endpoint", "status"], registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished sequences by finish reason (stop, length, "
                               "abort, error)", model + ["finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.tpot = histogram("time_per_output_token_seconds", "Per finished sequence: mean time per output token "
                              "after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", model,
                                     registry=r).labels(model_name)
        self.output_tokens = Counter(PREFIX + "generation_tokens", "Output tokens sent to clients", model,
                                     registry=r).labels(model_name)
        self.migrations = Counter(PREFIX + "request_migrations", "Requests moved to another router when theirs was "
                                  "lost, by whether tokens had been produced (resumed after them) or not (started over)",
                                  model + ["resumed"], registry=r)
        self.engine = EngineCollector(model_name, slots_per_worker)
        r.register(self.engine)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def count_finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def render(self, telemetry: list[dict[str, Any]], controller: dict[str, Any] | None = None) -> bytes:
        """The exposition text, with the routers' ``telemetry`` and the ``controller``'s status
        (either missing: its series keep their last values)."""
        self.engine.update(telemetry, controller)
        return generate_latest(self.registry)


class EngineCollector:
    """The routers' and the controller's cumulative values, as metric families (custom
    collector: counters stay counters although this process never increments them)."""

    def __init__(self, model_name: str, slots_per_worker: int):
        self.model_name = model_name
        self.slots_per_worker = slots_per_worker
        self.telemetry: list[dict[str, Any]] = []
        self.controller: dict[str, Any] | None = None

    def update(self, telemetry: list[dict[str, Any]], controller: dict[str, Any] | None) -> None:
        if telemetry:
            self.telemetry = telemetry
        if controller is not None:
            self.controller = controller

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the families depend on the telemetry

    def collect(self) -> Iterator[Metric]:
        if self.telemetry:
            yield from self._router_families(self.telemetry)
        if self.controller is not None:
            yield from self._controller_families(self.controller)

    # ---- families ------------------------------------------------------------------------
    def _family(self, kind: type, name: str, doc: str, value: float, **labels: str) -> Metric:
        family = kind(PREFIX + name, doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], value)
        return family

    def _router_families(self, telemetry: list[dict[str, Any]]) -> Iterator[Metric]:
        def total(key: str) -> float:
            return float(sum(t.get(key, 0) for t in telemetry))

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "num_requests_running", "Sequences in the routers' running batches",
                           total("requests_running"))
        yield self._family(gauge, "num_requests_waiting", "Sequences waiting for a place in a batch",
                           total("requests_waiting"))
        capacity = total("kv_cache_capacity_tokens")
        used = sum(t.get("kv_cache_usage", 0.0) * t.get("kv_cache_capacity_tokens", 0) for t in telemetry)
        yield self._family(gauge, "kv_cache_usage_perc", "Fraction of the routers' KV-cache blocks in use (0 to 1; "
                           "cached free blocks count as free)", used / capacity if capacity else 0.0)
        yield self._family(gauge, "kv_cache_capacity_tokens", "Tokens the routers' KV caches hold in all", capacity)
        yield self._family(counter, "num_preemptions", "Sequences preempted for want of KV blocks",
                           total("num_preemptions"))
        queries, hits = total("prefix_cache_queries"), total("prefix_cache_hits")
        yield self._family(counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield self._family(counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
        yield self._family(gauge, "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start",
                           hits / queries if queries else 0.0)
        yield self._family(counter, "router_generated_tokens", "Tokens the routers sampled, aborted requests' "
                           "included", total("generated_tokens"))
        yield self._queue_time(telemetry)
        # raymoe's own: where the expert assignments went.
        slot_tokens = np.sum([np.asarray(t["slot_tokens"], dtype=np.float64) for t in telemetry], axis=0)  # [L, P]
        worker_load = slot_tokens.reshape(slot_tokens.shape[0], -1, self.slots_per_worker).sum(axis=2)  # [L, W]
        routed = CounterMetricFamily(PREFIX + "worker_routed_tokens", "Expert assignments routed to each worker "
                                     "(all layers)", labels=["model_name", "worker"])
        for worker, tokens in enumerate(worker_load.sum(axis=0)):
            routed.add_metric([self.model_name, str(worker)], float(tokens))
        yield routed
        yield self._family(counter, "dropped_tokens", "Expert assignments dropped by the capacity policy",
                           total("dropped"))
        yield self._family(gauge, "balancedness", "Mean over MoE layers of mean/max worker load since start "
                           "(1 = perfect)", float(balancedness(worker_load)))

    def _queue_time(self, telemetry: list[dict[str, Any]]) -> Metric:
        """The routers' queue-time histograms added up (they share their bounds)."""
        snapshots = [t["queue_time"] for t in telemetry if "queue_time" in t]
        bounds = snapshots[0]["bounds"] if snapshots else list(LATENCY_BUCKETS)
        counts = np.sum([s["counts"] for s in snapshots], axis=0) if snapshots else np.zeros(len(bounds) + 1)
        cumulative = np.cumsum(counts)
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(bounds, cumulative)] + [("+Inf", float(cumulative[-1]))]
        family = HistogramMetricFamily(PREFIX + "request_queue_time_seconds", "Time from a sequence's arrival at a "
                                       "router to its first admission into a batch", labels=["model_name"])
        family.add_metric([self.model_name], buckets, sum_value=float(sum(s["sum"] for s in snapshots)))
        return family

    def _controller_families(self, controller: dict[str, Any]) -> Iterator[Metric]:
        window = GaugeMetricFamily(PREFIX + "window_balancedness", "Controller's window balancedness by statistic "
                                   "over layers", labels=["model_name", "stat"])
        window.add_metric([self.model_name, "avg"], controller["balancedness"])
        window.add_metric([self.model_name, "min"], controller["balancedness_min"])
        yield window
        counter = CounterMetricFamily
        yield self._family(counter, "rebalances", "Rebalances carried out", controller["rebalances"])
        yield self._family(counter, "migration_seconds", "Seconds spent migrating experts",
                           controller["migration_seconds"])
        yield self._family(counter, "migration_bytes", "Expert weight bytes copied by rebalances",
                           controller["bytes_moved"])
        if controller.get("autoscale"):
            yield from self._autoscale_families(controller["autoscale"])

    def _autoscale_families(self, auto: dict[str, Any]) -> Iterator[Metric]:
        """The autoscaler's decisions (actors/autoscaler.py): present only when it is on."""
        gauge = GaugeMetricFamily
        yield from self._pool_size_families(auto, "workers", "Expert workers")
        rows = auto.get("rows_per_step")
        per_worker = rows / auto["actual_workers"] if rows is not None and auto["actual_workers"] else 0.0
        yield self._family(gauge, "autoscale_rows_per_worker", "Expert rows each worker ran per MoE layer and "
                           "router step over the policy's window, at the last decision", per_worker)
        yield self._family(gauge, "autoscale_target_rows_per_worker", "autoscale.target_rows_per_worker",
                           auto["target_rows_per_worker"])
        yield from self._decision_families(auto, "", "")
        if auto.get("routers"):
            yield from self._router_autoscale_families(auto["routers"])

    def _router_autoscale_families(self, auto: dict[str, Any]) -> Iterator[Metric]:
        """The router pool's decisions (present only when routers are autoscaled)."""
        gauge = GaugeMetricFamily
        yield from self._pool_size_families(auto, "routers", "Routers")
        requests = auto.get("requests")
        per_router = requests / auto["actual_routers"] if requests is not None and auto["actual_routers"] else 0.0
        yield self._family(gauge, "autoscale_requests_per_router", "Running + waiting requests each router held, "
                           "averaged over the policy's window, at the last decision", per_router)
        yield self._family(gauge, "autoscale_target_requests_per_router", "autoscale.target_requests_per_router",
                           auto["target_requests_per_router"])
        if auto.get("target_queue_s") is not None:
            yield self._family(gauge, "autoscale_router_queue_time_seconds", "Mean time the window's admitted "
                               "sequences waited for a place in a batch, at the last decision (0: none admitted)",
                               auto.get("queue_s") or 0.0)
            yield self._family(gauge, "autoscale_target_queue_time_seconds", "autoscale.target_queue_s",
                               auto["target_queue_s"])
        yield from self._decision_families(auto, "router_", "router ")

    def _pool_size_families(self, auto: dict[str, Any], pool: str, title: str) -> Iterator[Metric]:
        """An autoscaled pool's desired and actual size and its limits (``pool``: workers or routers)."""
        gauge = GaugeMetricFamily
        yield self._family(gauge, f"autoscale_desired_{pool}", f"{title} the autoscaling policy wants",
                           auto[f"desired_{pool}"])
        yield self._family(gauge, f"autoscale_actual_{pool}", f"{title} serving now", auto[f"actual_{pool}"])
        yield self._family(gauge, f"autoscale_min_{pool}", f"autoscale.min_{pool}", auto[f"min_{pool}"])
        yield self._family(gauge, f"autoscale_max_{pool}", f"autoscale.max_{pool}", auto[f"max_{pool}"])

    def _decision_families(self, auto: dict[str, Any], tag: str, what: str) -> Iterator[Metric]:
        """A pool's last decision time and its resizes by direction (``tag``/``what``: "" for the
        workers, "router_"/"router " for the routers)."""
        yield self._family(GaugeMetricFamily, f"autoscale_{tag}last_decision_timestamp_seconds",
                           f"Unix time of the last {what}decision (0: none yet)", auto["last_decision_time"] or 0.0)
        doc = f"{what}resizes the autoscaling policy decided on, by direction (up: grow, down: shrink)"
        decisions = CounterMetricFamily(PREFIX + f"autoscale_{tag}decisions", doc[0].upper() + doc[1:],
                                        labels=["model_name", "direction"])
        for direction in ("up", "down"):
            decisions.add_metric([self.model_name, direction], float(auto["decisions"].get(direction, 0)))
        yield decisions
