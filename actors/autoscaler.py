"""The controller's autoscaler (issue 31 item 2): the ``autoscale:`` policy evaluated every
``interval_s`` from the routers' per-step expert loads (the expert pool) and the requests they
hold (the router pool, when the policy has router targets), and carried out by the
controller's ``resize`` (actors/resize.py) and ``resize_routers`` (actors/router_resize.py).

:class:`Autoscaler` is mixed into :class:`raymoe.actors.controller.Controller`, as recovery and
resize are. Its thread, every ``interval_s``:

1. reads each router's per-step logical-expert loads since its own cursor
   (``Router.expert_loads_since``: the telemetry the rebalancer reads; a router that does not
   answer within ``LOAD_READ_TIMEOUT_S`` is skipped that round) into time-stamped samples of
   steps of the group and expert rows per MoE layer (``group_sample``), kept for the
   policy's window, with the running and waiting sequences the routers hold (no step but
   requests held is a stall, not idle); with router targets also each router's queue-time
   histogram's count and sum (``Router.requests_held``; the sequences admitted
   since the last read, and how long they waited) into ``RouterSample``s;
2. asks :func:`raymoe.moe.autoscale_policy.decide` for the desired number of workers, given
   the pool's size and when it last changed (any worker resize: the autoscaler's, an
   operator's ``raymoe scale``), and :func:`~raymoe.moe.autoscale_policy.decide_routers` for
   the desired number of routers (its cooldown runs from the last router resize);
3. where one differs from the live size, calls ``resize`` or ``resize_routers`` (which refuse
   while a recovery, a rebalance or another resize runs: the next round decides again) and
   logs the decision; workers first, then routers (in a round without a worker resize: one
   resize at a time).

The last decisions (desired vs actual, the reason, when), the decisions made per pool and
direction and the last resizes it asked for are in ``status()["autoscale"]`` (``raymoe
status``, /metrics).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from typing import Any

import ray

from raymoe.moe.autoscale_policy import (AutoscaleDecision, AutoscalePolicy, LoadSample, QueueFloor, RouterDecision,
                                         RouterSample, decide, decide_routers, group_sample)
from raymoe.moe.resize_plan import min_workers

LOG = logging.getLogger("raymoe.autoscale")
LOAD_READ_TIMEOUT_S = 5.0


class Autoscaler:
    """The controller's autoscaling (module docstring): mixed into ``Controller``."""

    def _init_autoscale(self, policy: AutoscalePolicy | None) -> None:
        """Start the autoscaler's thread (nothing when ``policy`` is None: autoscaling is off)."""
        self.autoscale_policy = policy
        self.autoscale_decision: AutoscaleDecision | None = None
        self.autoscale_decisions = {"up": 0, "down": 0}
        self.autoscale_last_resize: dict[str, Any] | None = None
        self._autoscale_waits: str | None = None  # why a wanted resize waits (logged once)
        self._autoscale_samples: deque[LoadSample] = deque()
        # per router index: {"loads": expert_loads_since cursor, "queue": (admitted, seconds) so far};
        # recovery and router resizes pop a router's entry when its process changes
        self._autoscale_cursors: dict[int, dict[str, Any]] = {}
        self.autoscale_router_decision: RouterDecision | None = None
        self.autoscale_router_decisions = {"up": 0, "down": 0}
        self.autoscale_last_router_resize: dict[str, Any] | None = None
        self._autoscale_router_samples: deque[RouterSample] = deque()
        self._autoscale_queue_floor: QueueFloor | None = None
        self._autoscale_thread: threading.Thread | None = None
        if policy is None:
            return
        if not LOG.handlers:  # the decisions are INFO lines in the controller's log (Ray's worker stderr)
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            LOG.addHandler(handler)
            LOG.setLevel(logging.INFO)
            LOG.propagate = False
        # The experts must fit: never below the fewest workers whose slots hold every expert.
        floor = min_workers(self.placement.num_experts, self.placement.slots_per_worker)
        if policy.min_workers < floor:
            LOG.warning("autoscale.min_workers %d is below the %d workers whose slots hold every expert; using %d",
                        policy.min_workers, floor, floor)
            self.autoscale_policy = policy = policy.with_worker_floor(floor)
        self._autoscale_read()  # cursors at the routers' present: the window starts now
        self._autoscale_samples.clear()
        self._autoscale_router_samples.clear()
        self._autoscale_thread = threading.Thread(target=self._autoscale_loop, name="raymoe-autoscaler", daemon=True)
        self._autoscale_thread.start()

    # ---- telemetry ------------------------------------------------------------------------
    def _autoscale_read(self) -> None:
        """One sample of each pool's load: the router steps (and their expert rows per layer)
        since the last read, and the requests the routers hold; with router targets, a router
        sample too (the requests held, the sequences admitted since the last read and their
        queue seconds), only when every router answered (one left out would look like a
        smaller load)."""
        now = time.time()
        routers = list(self.routers)
        cursors = {index: self._autoscale_cursors.get(index) for index in range(len(routers))}
        refs = {index: router.expert_loads_since.remote(cursors[index]["loads"] if cursors[index] else 0)
                for index, router in enumerate(routers)}
        # (the requests held tell a stalled group from an idle one, for the workers too)
        telemetry = {index: router.requests_held.remote() for index, router in enumerate(routers)}
        everything = [*refs.values(), *telemetry.values()]
        ready = set(ray.wait(everything, num_returns=len(everything), timeout=LOAD_READ_TIMEOUT_S)[0])
        per_router: list[tuple[int, float]] = []
        requests, admitted, queue_s, answered = 0.0, 0, 0.0, 0
        for index, ref in refs.items():
            answer = self._answer(ref, ready)
            if answer is None:
                continue  # a router that is slow or lost this round: its steps count next time
            cursor, loads = answer
            report = self._answer(telemetry[index], ready)
            queue = None
            if report is not None:
                answered += 1
                requests += report.get("requests_running", 0) + report.get("requests_waiting", 0)
                histogram = report.get("queue_time") or {}
                queue = (int(sum(histogram.get("counts", []))), float(histogram.get("sum", 0.0)))
            before = cursors[index]
            self._autoscale_cursors[index] = {"loads": cursor, "queue": queue if queue is not None else (
                before or {}).get("queue")}
            if before is None:  # the first read only sets the cursors
                continue
            if len(loads):
                per_router.append((len(loads), float(loads.sum()) / loads.shape[1]))  # assignments per MoE layer
            if queue is not None and before.get("queue") is not None and queue[0] >= before["queue"][0]:
                admitted += queue[0] - before["queue"][0]
                queue_s += queue[1] - before["queue"][1]
        policy = self.autoscale_policy
        horizon = now - policy.window_s - policy.interval_s
        self._autoscale_samples.append(group_sample(now, per_router, requests if answered else None))
        while self._autoscale_samples and self._autoscale_samples[0].time < horizon:
            self._autoscale_samples.popleft()
        if policy.routers_on and answered == len(routers):
            self._autoscale_router_samples.append(RouterSample(now, requests, admitted, queue_s))
            while self._autoscale_router_samples and self._autoscale_router_samples[0].time < horizon:
                self._autoscale_router_samples.popleft()

    @staticmethod
    def _answer(ref: Any, ready: set) -> Any:
        """``ref``'s value if it came back in time and without an error, else None."""
        if ref not in ready:
            return None
        try:
            return ray.get(ref)
        except Exception:  # lost: recovery's business
            return None

    # ---- deciding -------------------------------------------------------------------------
    def _autoscale_loop(self) -> None:
        while not self._stopped.wait(self.autoscale_policy.interval_s):
            try:
                self.autoscale_step()
            except Exception as error:  # keep deciding; the last error is in status()
                LOG.warning("%s: %s", type(error).__name__, error)
                self.last = {"error": f"autoscale: {type(error).__name__}: {error}", "time": time.time()}

    def _last_resize_time(self, pool: str = "workers") -> float | None:
        """When ``pool`` (``workers`` or ``routers``) last changed size (by anyone), or the
        autoscaler last tried to resize it (a refused or rolled-back try waits out the cooldown
        too); None: neither yet. A router resize's report has ``routers_before``."""
        routers = pool == "routers"
        times = [r["time"] for r in self.resizes if r.get("resized") and ("routers_before" in r) == routers]
        mine = self.autoscale_last_router_resize if routers else self.autoscale_last_resize
        if mine is not None:
            times.append(mine["time"])
        return max(times) if times else None

    def autoscale_step(self) -> AutoscaleDecision:
        """Read the telemetry, decide, and resize if a decision says so (workers, then routers);
        returns the workers' decision."""
        self._autoscale_read()
        decision = self._autoscale_workers()
        # (after a worker resize, which takes seconds, this round's router telemetry is old:
        # the routers are decided on a fresh read next round)
        if self.autoscale_policy.routers_on and decision.desired == decision.current:
            self._autoscale_routers()
        return decision

    def _waits(self, wanted: str, reason: str) -> bool:
        """Whether a resize must wait for a recovery or another resize (said once in the log)."""
        if self.degraded is None and self.resizing is None:
            self._autoscale_waits = None
            return False
        waits = "a recovery is running" if self.degraded is not None else "a resize is running"
        if self._autoscale_waits != waits:  # said once, not every interval
            LOG.info("wants %s (%s) but waits: %s", wanted, reason, waits)
        self._autoscale_waits = waits
        return True

    def _autoscale_workers(self) -> AutoscaleDecision:
        current = len(self.workers)
        decision = decide(list(self._autoscale_samples), current, self._last_resize_time(), time.time(),
                          self.autoscale_policy)
        self.autoscale_decision = decision
        if decision.desired == current:
            return decision
        if self._waits(f"{decision.desired} workers", decision.reason):
            return decision
        self.autoscale_decisions[decision.direction] += 1
        LOG.info("%d -> %d workers: %s", current, decision.desired, decision.reason)
        report = self.resize(decision.desired)
        self.autoscale_last_resize = {key: report.get(key) for key in (
            "resized", "workers_before", "workers", "seconds", "pause_s", "copies", "bytes_copied", "bytes_all_experts",
            "error", "time")}
        self.autoscale_last_resize["time"] = report.get("time") or time.time()
        if report.get("resized"):
            LOG.info("now %d workers (%.2f s, paused %.3f s, %d expert copies)", report["workers"],
                     report["seconds"], report["pause_s"], report["copies"])
        else:
            LOG.warning("resizing to %d workers did not happen: %s", decision.desired,
                        report.get("error") or report.get("reason"))
        return decision

    def _autoscale_routers(self) -> RouterDecision:
        current = len(self.routers)
        decision = decide_routers(list(self._autoscale_router_samples), current, self._last_resize_time("routers"),
                                  time.time(), self.autoscale_policy, self._autoscale_queue_floor)
        self.autoscale_router_decision = decision
        self._autoscale_queue_floor = decision.floor
        if decision.desired == current or self._waits(f"{decision.desired} routers", decision.reason):
            return decision
        if self.routers_out:  # a lost router is being restarted: resize_routers would refuse
            return decision
        self.autoscale_router_decisions[decision.direction] += 1
        LOG.info("%d -> %d routers: %s", current, decision.desired, decision.reason)
        report = self.resize_routers(decision.desired)
        self.autoscale_last_router_resize = {key: report.get(key) for key in (
            "resized", "routers_before", "routers", "seconds", "pause_s", "drain_s", "start_s", "error")}
        self.autoscale_last_router_resize["routers_before"] = current
        self.autoscale_last_router_resize["time"] = report.get("time") or time.time()
        if report.get("resized"):
            LOG.info("now %d routers (%.2f s, paused %.3f s)", report["routers"], report["seconds"], report["pause_s"])
        else:
            LOG.warning("resizing to %d routers did not happen: %s", decision.desired,
                        report.get("error") or report.get("reason"))
        return decision

    def autoscale_status(self) -> dict[str, Any] | None:
        """What ``raymoe status`` and /metrics show; None when autoscaling is off."""
        policy = self.autoscale_policy
        if policy is None:
            return None
        decision = self.autoscale_decision
        return {
            "min_workers": policy.min_workers, "max_workers": policy.max_workers,
            "target_rows_per_worker": policy.target_rows_per_worker, "band": policy.band,
            "cooldown_s": policy.cooldown_s, "window_s": policy.window_s,
            "actual_workers": len(self.workers),
            "desired_workers": decision.desired if decision is not None else len(self.workers),
            "reason": decision.reason if decision is not None else "no decision yet",
            "rows_per_step": decision.rows_per_step if decision is not None else None,
            "last_decision_time": decision.time if decision is not None else None,
            "decisions": dict(self.autoscale_decisions),
            "last_resize": self.autoscale_last_resize,
            "routers": self._autoscale_router_status(),
        }

    def _autoscale_router_status(self) -> dict[str, Any] | None:
        """The router pool's part of ``autoscale_status``; None when routers are not autoscaled."""
        policy = self.autoscale_policy
        if not policy.routers_on:
            return None
        decision = self.autoscale_router_decision
        actual = len(self.routers)
        return {
            "min_routers": policy.min_routers, "max_routers": policy.max_routers,
            "target_requests_per_router": policy.target_requests_per_router, "target_queue_s": policy.target_queue_s,
            "actual_routers": actual,
            "desired_routers": decision.desired if decision is not None else actual,
            "reason": decision.reason if decision is not None else "no decision yet",
            "requests": decision.requests if decision is not None else None,
            "queue_s": decision.queue_s if decision is not None else None,
            "queue_floor": None if self._autoscale_queue_floor is None else {
                "routers": self._autoscale_queue_floor.routers, "requests": self._autoscale_queue_floor.requests},
            "last_decision_time": decision.time if decision is not None else None,
            "decisions": dict(self.autoscale_router_decisions),
            "last_resize": self.autoscale_last_router_resize,
        }
