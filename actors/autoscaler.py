"""The controller's autoscaler (issue 31 item 2): the ``autoscale:`` policy evaluated every
``interval_s`` from the routers' per-step expert loads, and carried out by the controller's
``resize`` (actors/resize.py).

:class:`Autoscaler` is mixed into :class:`raymoe.actors.controller.Controller`, as recovery and
resize are. Its thread, every ``interval_s``:

1. reads each router's per-step logical-expert loads since its own cursor
   (``Router.expert_loads_since``: the telemetry the rebalancer reads; a router that does not
   answer within ``LOAD_READ_TIMEOUT_S`` is skipped that round) into time-stamped samples of
   steps and expert rows per MoE layer (``LoadSample``), kept for the policy's window;
2. asks :func:`raymoe.moe.autoscale_policy.decide` for the desired size, given the pool's size
   and when it last changed (any resize: the autoscaler's, an operator's ``raymoe scale``);
3. if it differs from the pool's size, calls ``resize`` (which refuses while a recovery, a
   rebalance or another resize runs: the next round decides again) and logs the decision.

The last decision (desired vs actual, the reason, when), the decisions made per direction and
the last resize it asked for are in ``status()["autoscale"]`` (``raymoe status``, /metrics).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from typing import Any

import ray

from raymoe.moe.autoscale_policy import AutoscaleDecision, AutoscalePolicy, LoadSample, decide
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
        self._autoscale_cursors: dict[int, int] = {}
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
            self.autoscale_policy = policy = AutoscalePolicy(
                floor, max(floor, policy.max_workers), policy.target_rows_per_worker, policy.band, policy.cooldown_s,
                policy.window_s, policy.interval_s)
        self._autoscale_read()  # cursors at the routers' present: the window starts now
        self._autoscale_samples.clear()
        self._autoscale_thread = threading.Thread(target=self._autoscale_loop, name="raymoe-autoscaler", daemon=True)
        self._autoscale_thread.start()

    # ---- telemetry ------------------------------------------------------------------------
    def _autoscale_read(self) -> None:
        """One sample: the router steps (and their expert rows per layer) since the last read."""
        now = time.time()
        refs = {index: router.expert_loads_since.remote(self._autoscale_cursors.get(index, 0))
                for index, router in enumerate(self.routers)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=LOAD_READ_TIMEOUT_S)
        steps, rows = 0, 0.0
        for index, ref in refs.items():
            if ref not in ready:
                continue  # a router that is slow or lost this round: its steps count next time
            try:
                cursor, loads = ray.get(ref)
            except Exception:  # lost: recovery's business
                continue
            if index not in self._autoscale_cursors:  # the first read only sets the cursor
                self._autoscale_cursors[index] = cursor
                continue
            self._autoscale_cursors[index] = cursor
            if len(loads):
                steps += len(loads)
                rows += float(loads.sum()) / loads.shape[1]  # assignments per MoE layer
        self._autoscale_samples.append(LoadSample(now, steps, rows))
        horizon = now - self.autoscale_policy.window_s - self.autoscale_policy.interval_s
        while self._autoscale_samples and self._autoscale_samples[0].time < horizon:
            self._autoscale_samples.popleft()

    # ---- deciding -------------------------------------------------------------------------
    def _autoscale_loop(self) -> None:
        while not self._stopped.wait(self.autoscale_policy.interval_s):
            try:
                self.autoscale_step()
            except Exception as error:  # keep deciding; the last error is in status()
                LOG.warning("%s: %s", type(error).__name__, error)
                self.last = {"error": f"autoscale: {type(error).__name__}: {error}", "time": time.time()}

    def _last_resize_time(self) -> float | None:
        """When the pool last changed size (by anyone), or the autoscaler last tried to (a
        refused or rolled-back try waits out the cooldown too); None: neither yet."""
        times = [r["time"] for r in self.resizes if r.get("resized")]
        if self.autoscale_last_resize is not None:
            times.append(self.autoscale_last_resize["time"])
        return max(times) if times else None

    def autoscale_step(self) -> AutoscaleDecision:
        """Read the telemetry, decide, and resize if the decision says so; returns the decision."""
        self._autoscale_read()
        current = len(self.workers)
        decision = decide(list(self._autoscale_samples), current, self._last_resize_time(), time.time(),
                          self.autoscale_policy)
        self.autoscale_decision = decision
        if decision.desired == current:
            return decision
        if self.degraded is not None or self.resizing is not None:
            waits = "a recovery is running" if self.degraded is not None else "a resize is running"
            if self._autoscale_waits != waits:  # said once, not every interval
                LOG.info("wants %d workers (%s) but waits: %s", decision.desired, decision.reason, waits)
            self._autoscale_waits = waits
            return decision
        self._autoscale_waits = None
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
        }
