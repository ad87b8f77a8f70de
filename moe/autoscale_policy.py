"""When to grow or shrink the expert pool and the router pool (issue 31 item 2), as pure
math: no Ray, no clock.

Legend: L MoE layers, W workers, R routers, T tokens.

**Workers.** The signal is one the controller already reads: every router step's per-expert
loads (``[L, E]``; ``expert_loads_since``). Their sum over experts, averaged over layers, is
the expert assignments (token x expert rows) the routers hand to the expert pool per MoE
layer; per step of the group (routers step together: a poll's steps are the most any one
router made, so adding routers does not change the figure) and divided by the pool's ``W``
workers it is the **rows each worker runs per layer per step**, the quantity
``target_rows_per_worker`` names. It grows with the batch (more
sequences, longer prompt chunks, larger top-k) and does not depend on how fast steps are, so
a deployment whose workers are busy shows it before its latency does.

One evaluation (:func:`decide`) over the samples of the last ``window_s`` seconds (each
sample: a poll's time, router steps, assignments per layer) at ``W`` workers:

- ``rows`` = assignments per layer / steps over the window (0 when no step ran: idle);
- the size that load wants is ``ceil(rows / target)``, clamped to ``[min_workers, max_workers]``;
- a change is made only outside the hysteresis band: grow when each worker runs more than
  ``target * (1 + band)`` rows, shrink when it runs fewer than ``target * (1 - band)``;
- a window without a router step is idle only if the routers held no request in it (a
  stalled group, e.g. a long pause of the machine, holds requests: the pool holds);
- never within ``cooldown_s`` of the last resize, and only on a window that began after it
  (the samples before it describe the old size): the window must cover ``window_s`` seconds
  since the last resize.

Why it cannot flap: at a steady load the size it moves to is the same ``ceil(rows / target)``
whichever way it moves, and at that size the next evaluation wants that size again (a fixed
point), so the only changes are the load's own. The band keeps loads near a size boundary
from toggling between the two sizes as the load wobbles, and the cooldown bounds how often
a changing load can resize at all.

**Routers** (:func:`decide_routers`, on when ``target_requests_per_router`` is set). The
signal is the requests the routers hold (running plus waiting sequences, ``requests_held``),
summed over routers and averaged over the window's polls: with clients that keep ``C``
requests in flight it is ``C`` whatever ``R`` is, so the size it wants, ``ceil(requests /
target_requests_per_router)`` within ``[min_routers, max_routers]``, is a fixed point exactly
as the workers' is (the same band, cooldown and window rules, counted from the last *router*
resize). ``target_queue_s`` (optional) adds a second reason to grow: the mean time the window's
admitted sequences waited at a router for a place in a batch (the routers' queue-time
histograms) above ``target_queue_s * (1 + band)`` grows by one router even when the request
count would not. Queue time is not a fixed point (more routers, shorter queues), so a
queue-driven grow leaves a floor: no shrink below that size until the requests fall below
``(1 - band)`` times what they were when it grew, and never while the queue time is above
``target_queue_s * (1 - band)``; at a steady load the pool therefore stays where the queue
time put it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True)
class AutoscalePolicy:
    """The ``autoscale:`` section (cluster/config.py builds it): the workers' targets, and the
    routers' when ``target_requests_per_router`` is set (otherwise the router pool keeps its size)."""

    min_workers: int
    max_workers: int
    target_rows_per_worker: float  # expert rows a worker runs per MoE layer per step of the group
    band: float = 0.25  # hysteresis: grow above target*(1+band), shrink below target*(1-band)
    cooldown_s: float = 30.0  # no resize within this long of the last one (of the same pool)
    window_s: float = 10.0  # the telemetry one evaluation looks at
    interval_s: float = 2.0  # how often the controller evaluates
    min_routers: int | None = None  # router autoscaling: both limits and target_requests_per_router
    max_routers: int | None = None
    target_requests_per_router: float | None = None  # running + waiting sequences a router holds
    target_queue_s: float | None = None  # optional: mean queue time that grows the router pool

    @property
    def routers_on(self) -> bool:
        """Whether the router pool is autoscaled too."""
        return self.target_requests_per_router is not None

    def with_worker_floor(self, floor: int) -> "AutoscalePolicy":
        """This policy with ``min_workers`` (and ``max_workers``) at least ``floor``."""
        return replace(self, min_workers=max(floor, self.min_workers), max_workers=max(floor, self.max_workers))

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
        if self.routers_on:
            if self.min_routers is None or self.max_routers is None:
                problems.append("min_routers and max_routers are required with target_requests_per_router")
            elif self.min_routers < 1 or self.max_routers < self.min_routers:
                problems.append(f"router limits must be 1 <= min_routers <= max_routers, got {self.min_routers}.."
                                f"{self.max_routers}")
            if not self.target_requests_per_router > 0:
                problems.append(f"target_requests_per_router must be > 0, got {self.target_requests_per_router}")
        elif self.target_queue_s is not None:
            problems.append("target_queue_s needs target_requests_per_router (the size the load wants)")
        if self.target_queue_s is not None and not self.target_queue_s > 0:
            problems.append(f"target_queue_s must be > 0, got {self.target_queue_s}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class LoadSample:
    """What one poll of the routers brought: ``steps`` router steps that handed the pool
    ``rows`` expert assignments per MoE layer (summed over those steps), read at ``time``;
    ``requests``: the running + waiting sequences the routers held then (None: not read)."""

    time: float
    steps: int
    rows: float
    requests: float | None = None


def group_sample(time: float, per_router: Sequence[tuple[int, float]], requests: float | None = None) -> LoadSample:
    """One poll's :class:`LoadSample` from each answering router's ``(steps, rows)`` since its
    last read. Routers step together, so the group's steps are the most any router made
    (a router without work in a step records none) and the rows are every router's: the rows
    a worker runs per group step do not change when routers are added or removed."""
    return LoadSample(time, max((steps for steps, _ in per_router), default=0),
                      float(sum(rows for _, rows in per_router)), requests)


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


def _wanted(load: float, target: float, lo: int, hi: int) -> int:
    """``ceil(load / target)`` within ``[lo, hi]`` (no load wants ``lo``)."""
    wanted = math.ceil(load / target - 1e-9) if load > 0 else 0
    return min(hi, max(lo, wanted))


def _before_the_window(pool: str, resize: str, current: int, lo: int, hi: int, last_resize_time: float | None,
                       now: float, policy: AutoscalePolicy) -> tuple[str, int] | None:
    """What both pools decide before reading the window, as ``(reason, desired)``: a cooldown,
    a size outside the limits (e.g. an operator resized by hand), or a window that began before
    the last ``resize``; None when the window is to be read. ``pool``: "workers" or "routers"."""
    if last_resize_time is not None and now - last_resize_time < policy.cooldown_s:
        return (f"cooling down: last {resize} {now - last_resize_time:.1f} s ago, cooldown {policy.cooldown_s:g} s",
                current)
    if current < lo or current > hi:
        desired = min(hi, max(lo, current))
        return (f"{current} {pool} is outside [{lo}, {hi}] (autoscale.min_{pool}/max_{pool}): back to {desired}",
                desired)
    if last_resize_time is not None and last_resize_time > now - policy.window_s:
        return (f"collecting telemetry at {current} {pool}: {now - last_resize_time:.1f} of {policy.window_s:g} s "
                f"since the last {resize}", current)
    return None


def desired_size(rows_per_step: float, policy: AutoscalePolicy) -> int:
    """The workers ``rows_per_step`` assignments per layer and step want, within the limits."""
    return _wanted(rows_per_step, policy.target_rows_per_worker, policy.min_workers, policy.max_workers)


def decide(samples: Sequence[LoadSample], current: int, last_resize_time: float | None, now: float,
           policy: AutoscalePolicy) -> AutoscaleDecision:
    """Desired size of a pool of ``current`` workers (module docstring). ``last_resize_time``
    (None: never) is when the pool last changed size; ``samples`` may hold older ones."""
    def decision(reason: str, rows: float | None = None, desired: int = current) -> AutoscaleDecision:
        return AutoscaleDecision(desired, current, reason, rows, now)

    early = _before_the_window("workers", "resize", current, policy.min_workers, policy.max_workers,
                               last_resize_time, now, policy)
    if early is not None:
        return decision(early[0], desired=early[1])
    window = [s for s in samples if now - policy.window_s < s.time <= now]
    steps = sum(s.steps for s in window)
    held = max((s.requests for s in window if s.requests is not None), default=0.0)
    if not steps and held > 0:  # requests wait but no step ran: the group is stalled, not idle
        return decision(f"hold: no router step in the last {policy.window_s:g} s while the routers hold "
                        f"{held:.0f} requests (stalled, not idle)")
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


# ---- routers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterSample:
    """One poll of the routers: ``requests`` running plus waiting sequences they held in all
    at ``time``, and the ``admitted`` sequences that got a place in a batch since the last
    poll, which had waited ``queue_s`` seconds in all (0 and 0.0 without a queue reading)."""

    time: float
    requests: float
    admitted: int = 0
    queue_s: float = 0.0


@dataclass(frozen=True)
class QueueFloor:
    """A queue-driven grow's mark: no shrink below ``routers`` while the requests stay at or
    above ``(1 - band) * requests`` (module docstring)."""

    routers: int
    requests: float


@dataclass(frozen=True)
class RouterDecision:
    desired: int  # routers the policy wants (== current: hold)
    current: int
    reason: str
    requests: float | None  # running + waiting sequences over the window, summed over routers (None: not evaluated)
    queue_s: float | None  # mean queue time of the window's admitted sequences (None: none, or no queue target)
    time: float
    floor: QueueFloor | None = None  # the queue floor to keep after this decision

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"

    def to_dict(self) -> dict[str, object]:
        return {"desired": self.desired, "current": self.current, "direction": self.direction,
                "reason": self.reason, "requests": self.requests, "queue_s": self.queue_s, "time": self.time,
                "queue_floor": None if self.floor is None else {"routers": self.floor.routers,
                                                                "requests": self.floor.requests}}


def desired_routers(requests: float, policy: AutoscalePolicy) -> int:
    """The routers ``requests`` held requests want, within the limits."""
    return _wanted(requests, policy.target_requests_per_router, policy.min_routers, policy.max_routers)


def decide_routers(samples: Sequence[RouterSample], current: int, last_resize_time: float | None, now: float,
                   policy: AutoscalePolicy, floor: QueueFloor | None = None) -> RouterDecision:
    """Desired size of a pool of ``current`` routers (module docstring). ``last_resize_time``
    (None: never) is when the router pool last changed size; ``floor`` is the last decision's."""
    if not policy.routers_on:
        raise ValueError("router autoscaling is off: target_requests_per_router is not set")
    lo, hi = policy.min_routers, policy.max_routers

    def decision(reason: str, requests: float | None = None, queue_s: float | None = None, desired: int = current,
                 keep: QueueFloor | None = floor) -> RouterDecision:
        return RouterDecision(desired, current, reason, requests, queue_s, now, keep)

    early = _before_the_window("routers", "router resize", current, lo, hi, last_resize_time, now, policy)
    if early is not None:
        return decision(early[0], desired=early[1])
    window = [s for s in samples if now - policy.window_s < s.time <= now]
    if not window:
        return decision(f"no telemetry in the last {policy.window_s:g} s")
    requests = sum(s.requests for s in window) / len(window)
    admitted = sum(s.admitted for s in window)
    queue_s = sum(s.queue_s for s in window) / admitted if admitted and policy.target_queue_s is not None else None
    per_router = requests / current
    target, band = policy.target_requests_per_router, policy.band
    wanted = desired_routers(requests, policy)
    load = (f"{per_router:.1f} requests per router (target {target:g}, band {target * (1 - band):.1f}.."
            f"{target * (1 + band):.1f}) over {policy.window_s:g} s")
    if queue_s is not None:
        load += f", queue time {queue_s:.3f} s (target {policy.target_queue_s:g})"
    queue_high = queue_s is not None and queue_s > policy.target_queue_s * (1 + band)
    queue_low = queue_s is None or queue_s < policy.target_queue_s * (1 - band)
    if floor is not None and requests < floor.requests * (1 - band):
        floor = None  # the load the queue-driven size was for has gone
    if per_router > target * (1 + band) and wanted > current:
        return decision(f"grow: {load}", requests, queue_s, wanted, floor)
    if queue_high:
        if current < hi:
            grown = max(wanted, current + 1)
            return decision(f"grow: queue time above {policy.target_queue_s * (1 + band):.3f} s: {load}", requests,
                            queue_s, grown, QueueFloor(grown, requests))
        return decision(f"hold at autoscale.max_routers ({current}): {load}", requests, queue_s, keep=floor)
    if per_router > target * (1 + band):
        return decision(f"hold at autoscale.max_routers ({current}): {load}", requests, queue_s, keep=floor)
    if per_router < target * (1 - band) and wanted < current:
        if not queue_low:
            return decision(f"hold: {load}; the queue time is not below {policy.target_queue_s * (1 - band):.3f} s",
                            requests, queue_s, keep=floor)
        if floor is not None and floor.routers > wanted:
            if floor.routers < current:
                return decision(f"shrink: {load}; to the size queue time asked for at {floor.requests:.1f} "
                                f"requests", requests, queue_s, floor.routers, floor)
            return decision(f"hold: {load}; queue time asked for {floor.routers} routers at {floor.requests:.1f} "
                            f"requests", requests, queue_s, keep=floor)
        return decision(f"shrink: {load}", requests, queue_s, wanted, floor)
    if per_router < target * (1 - band) and current == lo:
        return decision(f"hold at autoscale.min_routers ({current}): {load}", requests, queue_s, keep=floor)
    return decision(f"hold: {load}", requests, queue_s, keep=floor)
