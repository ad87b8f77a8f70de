"""When to grow or shrink the expert pool (issue 31 item 2), as pure math: no Ray, no clock.

Legend: L MoE layers, W workers, T tokens.

The signal is one the controller already reads: every router step's per-expert loads
(``[L, E]``; ``expert_loads_since``). Their sum over experts, averaged over layers, is the
expert assignments (token x expert rows) one router step hands to the expert pool per MoE
layer; divided by the pool's ``W`` workers it is the **rows each worker runs per layer per
step**, the quantity ``target_rows_per_worker`` names. It grows with the batch (more
sequences, longer prompt chunks, larger top-k) and does not depend on how fast steps are, so
a deployment whose workers are busy shows it before its latency does.

One evaluation (:func:`decide`) over the samples of the last ``window_s`` seconds (each
sample: a poll's time, router steps, assignments per layer) at ``W`` workers:

- ``rows`` = assignments per layer / steps over the window (0 when no step ran: idle);
- the size that load wants is ``ceil(rows / target)``, clamped to ``[min_workers, max_workers]``;
- a change is made only outside the hysteresis band: grow when each worker runs more than
  ``target * (1 + band)`` rows, shrink when it runs fewer than ``target * (1 - band)``;
- never within ``cooldown_s`` of the last resize, and only on a window that began after it
  (the samples before it describe the old size): the window must cover ``window_s`` seconds
  since the last resize.

Why it cannot flap: at a steady load the size it moves to is the same ``ceil(rows / target)``
whichever way it moves, and at that size the next evaluation wants that size again (a fixed
point), so the only changes are the load's own. The band keeps loads near a size boundary
from toggling between the two sizes as the load wobbles, and the cooldown bounds how often
a changing load can resize at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class AutoscalePolicy:
    """The ``autoscale:`` section's worker targets (cluster/config.py builds it)."""

    min_workers: int
    max_workers: int
    target_rows_per_worker: float  # expert rows a worker runs per MoE layer per router step
    band: float = 0.25  # hysteresis: grow above target*(1+band), shrink below target*(1-band)
    cooldown_s: float = 30.0  # no resize within this long of the last one
    window_s: float = 10.0  # the telemetry one evaluation looks at
    interval_s: float = 2.0  # how often the controller evaluates

    def __post_init__(self) -> None:
        problems = []
        if self.min_workers < 1:
            problems.append(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            problems.append(f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})")
        if not self.target_rows_per_worker > 0:
            problems.append(f"target_rows_per_worker must be > 0, got {self.target_rows_per_worker}")
        if not 0 <= self.band < 1:
            problems.append(f"band must be in [0, 1), got {self.band}")
        if not self.cooldown_s >= 0:
            problems.append(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        for name in ("window_s", "interval_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class LoadSample:
    """What one poll of the routers brought: ``steps`` router steps that handed the pool
    ``rows`` expert assignments per MoE layer (summed over those steps), read at ``time``."""

    time: float
    steps: int
    rows: float


@dataclass(frozen=True)
class AutoscaleDecision:
    desired: int  # workers the policy wants (== current: hold)
    current: int
    reason: str  # for people: status, logs
    rows_per_step: float | None  # assignments per layer per step over the window (None: not evaluated)
    time: float

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"

    def to_dict(self) -> dict[str, object]:
        return {"desired": self.desired, "current": self.current, "direction": self.direction,
                "reason": self.reason, "rows_per_step": self.rows_per_step, "time": self.time}


def desired_size(rows_per_step: float, policy: AutoscalePolicy) -> int:
    """The workers ``rows_per_step`` assignments per layer and step want, within the limits."""
    wanted = math.ceil(rows_per_step / policy.target_rows_per_worker - 1e-9) if rows_per_step > 0 else 0
    return min(policy.max_workers, max(policy.min_workers, wanted))


def decide(samples: Sequence[LoadSample], current: int, last_resize_time: float | None, now: float,
           policy: AutoscalePolicy) -> AutoscaleDecision:
    """Desired size of a pool of ``current`` workers (module docstring). ``last_resize_time``
    (None: never) is when the pool last changed size; ``samples`` may hold older ones."""
    def decision(reason: str, rows: float | None = None, desired: int = current) -> AutoscaleDecision:
        return AutoscaleDecision(desired, current, reason, rows, now)

    if last_resize_time is not None and now - last_resize_time < policy.cooldown_s:
        return decision(f"cooling down: last resize {now - last_resize_time:.1f} s ago, cooldown "
                        f"{policy.cooldown_s:g} s")
    if current < policy.min_workers or current > policy.max_workers:  # e.g. an operator resized by hand
        desired = min(policy.max_workers, max(policy.min_workers, current))
        return decision(f"{current} workers is outside [{policy.min_workers}, {policy.max_workers}] "
                        f"(autoscale.min_workers/max_workers): back to {desired}", desired=desired)
    start = now - policy.window_s
    if last_resize_time is not None and last_resize_time > start:
        return decision(f"collecting telemetry at {current} workers: {now - last_resize_time:.1f} of "
                        f"{policy.window_s:g} s since the last resize")
    window = [s for s in samples if start < s.time <= now]
    steps = sum(s.steps for s in window)
    rows = sum(s.rows for s in window) / steps if steps else 0.0
    per_worker = rows / current
    target, band = policy.target_rows_per_worker, policy.band
    wanted = desired_size(rows, policy)
    load = (f"{per_worker:.1f} rows per worker per layer and step (target {target:g}, band "
            f"{target * (1 - band):.1f}..{target * (1 + band):.1f}) over {steps} router steps in {policy.window_s:g} s")
    if not steps:
        load = f"idle: no router step in the last {policy.window_s:g} s"
    if per_worker > target * (1 + band):
        if wanted > current:
            return decision(f"grow: {load}", rows, wanted)
        return decision(f"hold at autoscale.max_workers ({current}): {load}", rows)
    if per_worker < target * (1 - band):
        if wanted < current:
            return decision(f"shrink: {load}", rows, wanted)
        if current == policy.min_workers:
            return decision(f"hold at autoscale.min_workers ({current}): {load}", rows)
        return decision(f"hold: {load}; {current - 1} workers would each run more than the target", rows)
    return decision(f"hold: {load}", rows)
