"""Resizing the router pool while serving: the controller's ``resize_routers`` (a part of the
controller, like actors/resize.py is for the expert workers).

Grow to R' routers:

1. start routers R..R'-1 from the deploy-time recipe (actors/router_spec.py; detached, so a
   restarted controller does not take them with it); each loads the dense weights and warms
   its kernels in its constructor, bounded by ``ready_timeout_s``;
2. give them the supervisor and the placement in service, then rebuild the expert-parallel
   group with them (the one pause of a grow: every router waits for the rebuild);
3. the ingress replicas' relays see ``serving_routers()`` grow within a second and send them
   requests (actors/ingress.py).

Shrink to R' routers:

1. the leaving routers (the highest indices) stop getting new requests: ``serving_routers()``
   says R', and every relay stops picking them within a second;
2. what they hold finishes there (up to ``ROUTER_DRAIN_TIMEOUT_S``);
3. the group is rebuilt without them (the pause) and their actors end. A request still on one
   after the drain deadline moves to a live router when its actor ends (stream migration,
   actors/router_relay.py): nothing is lost.

A failed grow (a new router that does not load, or a rebuild that fails) ends the new routers
and rebuilds the group as it was. Refused (409) while another resize or a recovery runs, or
while a router is left out of the group.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raymoe.actors.recovery import CALL_TIMEOUT_S, _describe
from raymoe.actors.resize import RESIZE_REBALANCE_WAIT_S
from raymoe.actors.router_spec import start_router
from raymoe.actors.worker_spec import LiveWorkers

ROUTER_READY_TIMEOUT_S = 300.0  # a new router loads the dense weights and warms its kernels
ROUTER_DRAIN_TIMEOUT_S = 60.0  # a leaving router's requests may finish there this long
RELAY_REFRESH_S = 1.0  # how often an ingress relay asks which routers serve (actors/ingress.py)


class RouterResize:
    """The controller's router resize (module docstring): mixed into ``Controller``."""

    def _init_router_resize(self, router_spec: Any) -> None:
        self.router_spec = router_spec
        self.serving_count: int | None = None  # None: every router takes requests

    def serving_routers(self) -> dict[str, int]:
        """How many routers there are and how many take new requests (the first ``serving``;
        the others are leaving). The ingress relays ask this every second."""
        count = len(self.routers)
        return {"routers": count, "serving": count if self.serving_count is None else min(self.serving_count, count)}

    def resize_routers(self, routers: int, ready_timeout_s: float = ROUTER_READY_TIMEOUT_S) -> dict[str, Any]:
        """Grow or shrink the router pool to ``routers`` while serving. Returns a report:
        ``resized``, ``routers_before``/``routers``, ``seconds`` (from the call to serving at the
        new size), ``pause_s`` (the group rebuild), ``drain_s`` (a shrink's wait for the leaving
        routers' requests); refused: ``refused`` True, ``error`` and ``status`` (400, 409)."""
        if type(routers) is not int or routers < 1:
            return self._refused(f"routers must be an integer >= 1, got {routers!r}", 400, "routers")
        if not self._resize_lock.acquire(blocking=False):
            return self._refused("another resize is running; try again when it has finished", 409, "routers")
        try:
            before = len(self.routers)
            if self.routers_out:
                return self._refused(f"routers {sorted(self.routers_out)} were lost and are being restarted; "
                                     "resizing waits until the deployment is whole again", 409, "routers")
            if self.degraded is not None or self._recover_lock.locked():
                return self._refused("a recovery is running; resizing waits until the deployment is whole "
                                     "again", 409, "routers")
            if self.router_spec is None:
                return self._refused("this controller has no router recipe (it was not started by deploy); "
                                     "it cannot start routers", 400, "routers")
            if routers == before:
                return {"resized": False, "routers_before": before, "routers": before,
                        "reason": f"already {before} routers", "time": time.time()}
            if not self._rebalance_lock.acquire(timeout=RESIZE_REBALANCE_WAIT_S):
                return self._refused(f"a rebalance has been running for over {RESIZE_REBALANCE_WAIT_S:.0f} s; "
                                     "try again when it has finished", 409, "routers")
            self.resizing = {"routers": routers, "since": time.time()}
            try:
                report = (self._grow_routers(routers, ready_timeout_s) if routers > before
                          else self._shrink_routers(routers))
            finally:
                self.resizing = None
                self._rebalance_lock.release()
            report.update(routers_before=before, time=time.time())
            self.last_resize = report
            self.resizes.append(report)
            self._count("resizes" if report.get("resized") else "resize_rollbacks")
            return report
        finally:
            self._resize_lock.release()

    def _members(self) -> list[int]:
        return list(range(len(self.workers)))

    def _grow_routers(self, target: int, ready_timeout_s: float) -> dict[str, Any]:
        started = time.perf_counter()
        before = len(self.routers)
        spec = self.router_spec
        workers = LiveWorkers(list(self.workers), spec.name, spec.namespace)
        new = [start_router(spec, r, target, self.placement.to_dict(), workers, detached=True)
               for r in range(before, target)]
        try:
            infos = ray.get([router.info.remote() for router in new], timeout=ready_timeout_s)
        except Exception as error:
            self._end_routers(new, before)
            return self._router_failure(f"new routers did not start within {ready_timeout_s:.0f} s: "
                                        f"{_describe(error)}", started)
        start_s = time.perf_counter() - started
        me = ray.get_runtime_context().current_actor
        with self._recover_lock:
            ray.get([r.set_supervisor.remote(me) for r in new] +
                    [r.set_placement.remote(self.placement.to_dict()) for r in new], timeout=CALL_TIMEOUT_S)
            self._add_routers(new, [info["pid"] for info in infos])
            paused = time.perf_counter()
            try:
                self._rebuild_groups(self._members())
            except Exception as error:
                self._drop_routers(before)
                self._end_routers(new, before)
                rolled = self._rebuild_quietly()
                return self._router_failure(f"rebuilding the group with the new routers failed: {_describe(error)}",
                                            started, rolled)
            pause_s = time.perf_counter() - paused
        return {"resized": True, "routers": target, "seconds": time.perf_counter() - started, "start_s": start_s,
                "pause_s": pause_s}

    def _shrink_routers(self, target: int) -> dict[str, Any]:
        started = time.perf_counter()
        leaving = list(self.routers[target:])
        self.serving_count = target  # the relays stop picking the leaving routers within RELAY_REFRESH_S
        try:
            drained = self._drain(leaving)
            drain_s = time.perf_counter() - started
            with self._recover_lock:
                for router in leaving:
                    try:
                        ray.get(router.abort_comm.remote(), timeout=CALL_TIMEOUT_S)
                    except Exception:
                        pass  # it is ended below all the same
                self._drop_routers(target)
                paused = time.perf_counter()
                try:
                    self._rebuild_groups(self._members())
                except Exception as error:  # the group over the routers that stay: recovery's business now
                    self.last = {"error": f"rebuilding the group after a router shrink: {_describe(error)}",
                                 "time": time.time()}
                pause_s = time.perf_counter() - paused
            self._end_routers(leaving, target)
        finally:
            self.serving_count = None
        return {"resized": True, "routers": target, "seconds": time.perf_counter() - started, "drain_s": drain_s,
                "drained": drained, "pause_s": pause_s}

    def _drain(self, leaving: list[Any]) -> bool:
        """Wait until the leaving routers hold no request (after the relays have heard, two
        refreshes), at most ``ROUTER_DRAIN_TIMEOUT_S``; whether they emptied."""
        deadline = time.monotonic() + ROUTER_DRAIN_TIMEOUT_S
        earliest = time.monotonic() + 2 * RELAY_REFRESH_S
        while time.monotonic() < deadline:
            try:
                held = sum(ray.get([r.num_unfinished.remote() for r in leaving], timeout=CALL_TIMEOUT_S))
            except Exception:
                return False  # a leaving router is lost: its requests move when it ends
            if held == 0 and time.monotonic() >= earliest:
                return True
            time.sleep(0.2)
        return False

    def _add_routers(self, handles: list[Any], pids: list[int]) -> None:
        start = len(self.routers)
        self.routers.extend(handles)
        self.router_pids.extend(pids)
        self.cursors.extend([0] * len(handles))
        self.groups["router_ids"] = [f"router-{r}" for r in range(start + len(handles))]
        self._forget_cursors(range(start, len(self.routers)))

    def _drop_routers(self, keep: int) -> None:
        self._forget_cursors(range(keep, len(self.routers)))
        del self.routers[keep:], self.router_pids[keep:], self.cursors[keep:]
        self.groups["router_ids"] = [f"router-{r}" for r in range(keep)]

    def _forget_cursors(self, indices: range) -> None:
        """The autoscaler's telemetry cursors of routers that are new or gone (its next read of
        a new one only sets it: actors/autoscaler.py)."""
        for index in indices:
            getattr(self, "_autoscale_cursors", {}).pop(index, None)

    def _end_routers(self, handles: list[Any], first: int) -> None:
        """End ``handles`` (routers ``first``, ``first + 1``, ...) and wait (at most 10 s) until
        their names are free again, so that a grow right after can start routers under them."""
        for router in handles:
            try:
                ray.get(router.shutdown.remote(), timeout=15)
            except Exception:
                pass  # ended below all the same
            try:
                ray.kill(router, no_restart=True)
            except Exception:
                pass
        deadline = time.monotonic() + 10
        for index in range(first, first + len(handles)):
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(self.router_spec.actor_name(index), namespace=self.router_spec.namespace)
                except ValueError:
                    break
                time.sleep(0.1)

    def _rebuild_quietly(self) -> str:
        try:
            self._rebuild_groups(self._members())
            return "the group rebuilt over the routers before the grow"
        except Exception as error:
            return f"rebuilding the group failed too ({_describe(error)}): recovery rebuilds it"

    def _router_failure(self, message: str, started: float, rolled_back: str = "nothing had changed") -> dict[str, Any]:
        self.last = {"error": f"router resize failed: {message}", "time": time.time()}
        return {"resized": False, "error": message, "rolled_back": rolled_back, "routers": len(self.routers),
                "seconds": time.perf_counter() - started, "status": 500}
