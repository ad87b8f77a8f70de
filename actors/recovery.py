"""Failure recovery of the controller actor: rebuild the groups after a failed step, serve on
the survivors' replicas, re-include restarted workers, reload experts into them.

:class:`Recovery` is the recovery half of :class:`raymoe.actors.controller.Controller` (which
keeps telemetry and rebalancing, and inherits these methods, so ``recover`` is one of the
controller actor's calls). A router whose step failed calls ``recover(generation)``:

1. ping every worker; one that is dead or does not answer is lost, a frozen one is killed so
   that Ray restarts it (a worker reloads its experts from the checkpoint);
2. if every lost expert has a replica on a survivor, serve on the survivors at once (the lost
   workers' slots empty in a new epoch, the groups rebuilt over the survivors) and re-include
   the lost workers in the background once Ray has restarted them (``_reinclude``: retried
   with backoff; a failed switch rolls back onto the replicas). On the CPU transports the
   re-include is make-before-break (``_switch_live``): the new group forms beside the one in
   service and every rank switches to it at one agreed step boundary, so nobody stops; on
   NCCL every rank stops, joins and resumes (``_stop_and_switch``);
3. otherwise wait for the restarted workers, load the placement in service into them
   (``_reload``: a deadline from the pool's bytes, retried on a timeout), give restarted
   routers the supervisor and placement back, and rebuild every group.

A step that fails the same way after every rebuild (``MAX_IDENTICAL_STEP_FAILURES``) raises
:class:`RepeatedStepFailure`. :func:`join_ep_group` builds the deployment's one
expert-parallel group, for deploy (cluster/deploy.py) and for recovery.

State it keeps (``_init_recovery``): ``generation``, ``recoveries``, ``degraded``, the
recovery lock, the re-include thread, the failure streak. What it uses of its host, the
controller: ``routers``, ``workers``, ``placement``, ``groups``, ``worker_pids``,
``router_pids``, ``cursors``, ``pool_bytes``, ``last``, ``_stopped``, and ``_count``,
``_fault``, ``_new_table`` (epochs are never reused, also across rebalances) and
``_join_migration_group``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from raymoe.actors.rank_watch import RankWatching, actor_table_entry
from raymoe.actors.expert_worker import switch_mark
from raymoe.kernels.comm import CommBackend
from raymoe.kernels.comm import errors as comm_errors
from raymoe.moe.placement import PlacementTable

CALL_TIMEOUT_S = 60.0
# Loading the placement into a restarted worker (ExpertWorker.load_placement) reads up to its
# whole expert pool from the checkpoint and packs it: its deadline grows with the pool's bytes,
# RELOAD_FLOOR_S plus the bytes at RELOAD_MIN_BYTES_PER_S, a rate below what a cold local disk
# or a network filesystem gives (a CPU worker here loads and packs ~0.6 GB/s from the page
# cache); 16 GiB of experts get 60 + 328 s. A reload that still times out is tried again
# (the worker serializes reloads: a retry waits for the one still running, then finds every
# row in place), RELOAD_ATTEMPTS tries in all, RELOAD_FIRST_BACKOFF_S doubling between them.
RELOAD_FLOOR_S = 60.0
RELOAD_MIN_BYTES_PER_S = 50 * 2**20
RELOAD_ATTEMPTS = 3
RELOAD_FIRST_BACKOFF_S = 2.0
PING_TIMEOUT_S = 5.0  # a worker that cannot answer `info` in this long is treated as lost
PING_STATE_POLL_S = 0.05  # meanwhile Ray's actor table is read this often: not alive there is lost at once
# A router of the group that cannot say its pid in this long is left out of the next group (not
# killed: the rank watch kills a wedged one) and re-included once it answers; a call to a
# router that was just killed waits for its restart, which must not hold the others.
ROUTER_PING_TIMEOUT_S = 1.0
RESTART_TIMEOUT_S = 300.0
LOST = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError)
# Re-including restarted workers: attempt k waits REINCLUDE_FIRST_BACKOFF_S * 2**(k-1) (at most
# REINCLUDE_MAX_BACKOFF_S) after a failure; after REINCLUDE_MAX_ATTEMPTS the deployment stays on
# the replicas and says so in status(); the next recovery starts a new round of attempts.
REINCLUDE_MAX_ATTEMPTS = 6
REINCLUDE_FIRST_BACKOFF_S = 1.0
REINCLUDE_MAX_BACKOFF_S = 30.0
# A step that fails this many recoveries in a row with the same workers' errors (and no step
# served in between) fails deterministically: its requests are failed, not retried for ever.
MAX_IDENTICAL_STEP_FAILURES = 3
# Where a test may make recovery fail on purpose (Controller.inject_fault): loading the
# placement into a restarted worker, joining the groups that re-include it, and a recovery's
# own switch to the new group (as when a survivor is lost in the middle of it).
RECOVERY_FAULT_POINTS = ("reinclude_load", "reinclude_join", "recovery_switch", "reinclude_hold")
# reinclude_hold is no failure: the re-include holds the new group, formed beside the one in
# service, this long before the switch mark, so that a test sees serving go on meanwhile.
REINCLUDE_HOLD_S = 3.0
# The re-include's make-before-break (``Recovery._switch_live``): transports on which a new group
# may form beside the live one, and how long every rank has to switch after the mark (else every
# rank is stopped and the group rebuilt, ``_stop_and_switch``).
LIVE_SWITCH_BACKENDS = (CommBackend.SOCKETS, CommBackend.GLOO)
LIVE_SWITCH_TIMEOUT_S = 10.0


class RepeatedStepFailure(RuntimeError):
    """The same step failed the same way after every rebuild: retrying cannot help."""


def join_ep_group(routers: list[Any], workers: list[Any], members: list[int], backend: str, timeout_s: float,
                  generation: int, router_members: list[int] | None = None) -> None:
    """The deployment's one expert-parallel group: router ``router_members[r]`` (default: every
    router) is rank ``r``, worker ``members[i]`` is rank ``len(router_members) + i``. Every rank
    must join or none completes; deploy, resize and recovery all build the group here."""
    joined = list(range(len(routers))) if router_members is None else list(router_members)
    rendezvous = ray.get(routers[joined[0]].rendezvous.remote(), timeout=CALL_TIMEOUT_S)
    num_routers = len(joined)
    ray.get([routers[index].join.remote(rendezvous, generation, members, rank, num_routers)
             for rank, index in enumerate(joined)] + [
        workers[w].join.remote(backend, rendezvous, num_routers + rank, num_routers, members, timeout_s, generation)
        for rank, w in enumerate(members)
    ], timeout=CALL_TIMEOUT_S)


def _gather(refs: list[Any], timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
    """``ray.get(refs)``, but a failed call raises as soon as it fails, not once every other
    call has ended (a copy collective's peers wait in it until the failure is cleaned up)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls did not finish in {timeout_s} s")
        ray.get(ready)
    return ray.get(list(refs))


def _until_available_all(calls: list[Any], timeout_s: float = RESTART_TIMEOUT_S) -> list[Any]:
    """``_until_available`` of every call, issued all at once (one round trip, not one each)."""
    refs = [call() for call in calls]
    results = []
    for call, ref in zip(calls, refs):
        try:
            results.append(ray.get(ref, timeout=CALL_TIMEOUT_S))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            results.append(_until_available(call, timeout_s))
    return results


def _describe(error: BaseException) -> str:
    """``Type: text`` of the error a remote call raised (not Ray's wrapper and traceback)."""
    cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    lines = str(error).strip().splitlines()  # Ray's text ends with the remote error's own line
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def _is_comm_error(message: str) -> bool:
    """Whether a worker's ``last_error`` ("Type: text") is a communicator's error."""
    name = message.split(":", 1)[0]
    return isinstance(getattr(comm_errors, name, None), type) and issubclass(getattr(comm_errors, name),
                                                                             comm_errors.CommError)


def reload_deadline_s(pool_bytes: int) -> float:
    """How long one ``load_placement`` of a worker whose pool holds ``pool_bytes`` may take."""
    return RELOAD_FLOOR_S + max(0, pool_bytes) / RELOAD_MIN_BYTES_PER_S


def retry_on_timeout(attempt, what: str, attempts: int = RELOAD_ATTEMPTS, first_backoff_s: float = RELOAD_FIRST_BACKOFF_S,
                     on_timeout=None, sleep=None) -> Any:
    """``attempt()``, tried again after a ``GetTimeoutError`` (``first_backoff_s``, doubling),
    ``attempts`` tries in all; the last timeout is raised, saying how many tries there were.
    ``on_timeout(error)`` is called for each timeout (a counter)."""
    backoff = first_backoff_s
    for number in range(1, attempts + 1):
        try:
            return attempt()
        except ray.exceptions.GetTimeoutError as error:
            if on_timeout is not None:
                on_timeout(error)
            if number == attempts:
                raise ray.exceptions.GetTimeoutError(f"{what} timed out {attempts} times: {error}") from error
            (sleep or time.sleep)(backoff)
            backoff *= 2


def _until_available(call, timeout_s: float = RESTART_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """``ray.get(call(), timeout=call_timeout_s)``, retried while the actor is between restarts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(call(), timeout=call_timeout_s)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Recovery(RankWatching):  # RankWatching: wedged ranks found and killed (actors/rank_watch.py)
    """The controller's recovery (module docstring): mixed into ``Controller``."""

    def _init_recovery(self) -> None:
        """Recovery's own state; the controller's constructor calls this first."""
        self.generation = 0
        self.recoveries: list[dict[str, Any]] = []
        self.degraded: dict[str, Any] | None = None  # lost workers while replicas serve for them
        self._recover_lock = threading.Lock()
        self._reinclude_thread: threading.Thread | None = None
        # The last recovery's workers' errors, how many recoveries in a row saw them, and the
        # steps the workers had served then (a served step ends a streak).
        self._failure_streak: tuple[tuple, int, int] = ((), 0, -1)
        # Routers left out of the group: lost (dead, restarting or frozen and killed), back in once
        # Ray has restarted them (``_reinclude_routers``); the others serve on meanwhile.
        self.routers_out: set[int] = set()
        self.killed_pids: dict[int, int] = {}  # worker -> the pid recovery killed, until a new one answers
        self._router_thread: threading.Thread | None = None
        self._phases: list | None = None  # the re-include's phase ends, while one runs (its record's "phases")
        self._phase_start = 0.0
        self._init_rank_watch()  # its thread waits for the constructor to finish

    # ---- failure recovery -------------------------------------------------------------------
    def recover(self, generation: int) -> int:
        """Rebuild every communicator group after a failed step; returns the new generation.

        Called by each router whose step failed with the generation of its group; the first
        caller does the work, later callers of the same generation return at once.

        1. Ping every worker; one that is dead or does not answer is lost.
        2. Kill lost workers that are merely frozen, so Ray restarts them (a worker is
           restartable: it reloads its experts from the checkpoint). If every lost expert has
           a replica on a survivor, serve on the survivors at once (``_serve_on_replicas``).
        3. Otherwise wait for the restarted workers and load the current placement into them.
        4. Abort every old communicator and join every router with every worker anew.

        Raises :class:`RepeatedStepFailure` (after rebuilding the groups, so serving goes on)
        when the step failed ``MAX_IDENTICAL_STEP_FAILURES`` times in a row with the same
        workers' errors and nobody lost: a deterministic compute error, which a retry only
        repeats. The calling router fails its requests in flight with that message.
        """
        with self._recover_lock:
            if generation < self.generation:
                return self.generation
            started = time.perf_counter()
            self._phase_start, self._phases = started, []
            self._count("recoveries")
            # Step 1: who answers, and who was restarted already (a new pid)? Workers left out
            # while the replicas serve for them are the re-include thread's business.
            excluded = set(self.degraded["lost"]) if self.degraded is not None else set()
            members = [w for w in range(len(self.workers)) if w not in excluded]
            answers = {index: self.workers[index].info.remote() for index in members}
            lost, restarted, frozen, infos = [], [], [], {}
            for index, answer in answers.items():
                if self._rank_watch.is_wedged(f"worker {index}"):  # killed by the watch: not worth a 5 s ping
                    lost.append(index)  # (a partitioned node's worker: the kill lands once the link is back)
                    self.killed_pids[index] = self.worker_pids[index]
                    continue
                try:
                    infos[index] = self._ping(self.workers[index], answer)
                    if infos[index] is None:
                        lost.append(index)  # Ray's actor table says it is dead or restarting
                    elif infos[index]["pid"] != self.worker_pids[index]:
                        restarted.append(index)
                except ray.exceptions.GetTimeoutError:
                    frozen.append(index)  # alive but not answering
                except LOST:
                    lost.append(index)  # dead: Ray is restarting it already
            infos = {index: info for index, info in infos.items() if info is not None}
            self._phase("pinged")
            repeated = self._repeated_failure(infos, any_lost=bool(lost or frozen or restarted))
            if self.degraded is not None and not self._reinclude_running():
                self._start_reinclude()  # an earlier round of attempts gave up: try again
            # Step 2: a frozen worker cannot serve: kill it so that Ray restarts it too.
            for index in frozen:
                ray.kill(self.workers[index], no_restart=False)
                self.killed_pids[index] = self.worker_pids[index]  # until it is gone (see _wait_restarted)
            lost = sorted(lost + frozen)
            for index in restarted:  # back already: it serves the placement in service
                self.worker_pids[index] = self._wait_restarted(self.workers[index], self._restart_timeout_s(),
                                                               self.killed_pids.pop(index, None))
                self._reload(index, self.placement)
            if lost and self.degraded is None and self._covered_without(lost):
                return self._serve_on_replicas(lost, restarted, started)
            # Step 3: wait for them, then give them the placement in service (a worker Ray
            # will not restart gets a new actor: actors/self_heal.py).
            self._replace_dead_workers(lost)
            for index in lost:
                self.worker_pids[index] = self._wait_restarted(self.workers[index], self._restart_timeout_s(),
                                                               self.killed_pids.pop(index, None))
                self._reload(index, self.placement)
            lost = sorted(lost + restarted)
            # Step 3b: routers. One that is lost (its requests move to live routers, see
            # actors/router_relay.py) is left out of the group and re-included once it is back.
            restarted_routers, left_out = self._check_routers()
            # Step 4: new groups, one per router, every member joins.
            self._rebuild_groups(members, fault_point="recovery_switch")
            next_generation = self.generation
            self._phases = None
            self.recoveries.append({"time": time.time(), "lost_workers": lost, "restarted_routers": restarted_routers,
                                    "routers_left_out": left_out, "mode": "restart", "generation": next_generation,
                                    "seconds": time.perf_counter() - started})
            if repeated is not None:
                self._count("repeated_step_failures")
                self._failure_streak = ((), 0, -1)  # the next requests get their own retries
                self.last = {"error": repeated, "time": time.time()}
                raise RepeatedStepFailure(repeated)
            return self.generation

    @staticmethod
    def _ping(actor: Any, answer: Any) -> dict[str, Any] | None:
        """``answer`` (the worker's ``info``) within ``PING_TIMEOUT_S``, or None as soon as Ray's
        actor table says the actor is not alive (restarting or dead): a call to a SIGKILLed actor
        fails only after ~1.3-1.6 s here, while its table row says RESTARTING within ~30 ms of
        the kill, and that wait was most of the streams' pause at the fault. Raises what the call
        raises; ``GetTimeoutError`` when it does not answer in time (frozen)."""
        deadline = time.monotonic() + PING_TIMEOUT_S
        while True:
            ready, _ = ray.wait([answer], timeout=max(0.0, min(PING_STATE_POLL_S, deadline - time.monotonic())))
            if ready:
                return ray.get(answer)
            if actor_table_entry(actor._actor_id.hex()).get("State", "ALIVE") not in ("ALIVE", "DEPENDENCIES_UNREADY"):
                return None
            if time.monotonic() >= deadline:
                return ray.get(answer, timeout=0)  # GetTimeoutError: alive, not answering

    def _repeated_failure(self, infos: dict[int, dict[str, Any]], any_lost: bool) -> str | None:
        """The message to fail the step's requests with, if this recovery is the
        ``MAX_IDENTICAL_STEP_FAILURES``-th in a row to find the same workers' compute errors
        (not communication errors: those are what a rebuild fixes), with no worker lost and no
        step served since the last one; else None."""
        errors = tuple(sorted((index, info["last_error"]) for index, info in infos.items()
                              if info["last_error"] and not _is_comm_error(info["last_error"])))
        served = sum(info["steps_served"] for info in infos.values())
        previous, streak, previous_served = self._failure_streak
        if any_lost or not errors:
            self._failure_streak = ((), 0, served)
            return None
        streak = streak + 1 if errors == previous and served == previous_served else 1
        self._failure_streak = (errors, streak, served)
        if streak < MAX_IDENTICAL_STEP_FAILURES:
            return None
        named = "; ".join(f"worker {index}: {error}" for index, error in errors)
        return (f"the step failed {streak} times in a row with the same error after every rebuild ({named}); "
                "this is not a lost peer but a deterministic failure, so the requests in flight are failed "
                "instead of retried (see the workers' logs)")

    def _rebuild_groups(self, members: list[int], fault_point: str | None = None, stopped: bool = False) -> None:
        """Abort every communicator (unless ``stopped`` already) and join every router with
        ``members`` (worker indices) anew."""
        if not stopped:
            self._stop_everyone(members)
        self._fault(fault_point)
        next_generation = self.generation + 1
        if len(members) == len(self.workers):
            # Before the EP group, while no worker serves one (the routers wait in recover and
            # carry no mark): no communicator is created beside live collectives.
            self._join_migration_group()
            self._phase("migration joined")
        join_ep_group(self.routers, self.workers, members, self.groups["backend"], self.groups["timeout_s"],
                      next_generation, self.router_members())
        self._phase("joined")
        self.generation = next_generation

    def _switch_groups(self, table: PlacementTable, base_epoch: int, activate_on: list[int],
                       members: list[int], fault_point: str | None = None) -> None:
        """Serve ``table`` with groups over ``members``: workers in ``activate_on`` add its epoch,
        routers stop (comms aborted), switch placement, and join the new groups."""
        self._activate(table, base_epoch, activate_on)
        self._stop_and_switch(table, members, fault_point)

    def _activate(self, table: PlacementTable, base_epoch: int, workers: list[int]) -> None:
        """``workers`` (indices) serve ``table``'s epoch beside ``base_epoch``'s."""
        ray.get([self.workers[w].activate.remote(table.epoch, base_epoch, table.to_dict()) for w in workers],
                timeout=CALL_TIMEOUT_S)
        self._phase("activated")

    def _stop_and_switch(self, table: PlacementTable, members: list[int], fault_point: str | None = None) -> None:
        """Every rank stops (routers' communicators aborted, workers' reset, all at once), the
        routers switch to ``table`` (every worker of ``members`` serves its epoch already) and
        the groups are rebuilt over ``members``."""
        self._stop_everyone(members)
        ray.get([r.set_placement.remote(table.to_dict()) for r in self.group_routers()], timeout=CALL_TIMEOUT_S)
        self._phase("placement set")
        self._rebuild_groups(members, fault_point, stopped=True)

    def _stop_everyone(self, members: list[int]) -> None:
        """Abort every router's communicator and reset every worker of ``members``, all calls at
        once (a rank between restarts is waited for)."""
        _until_available_all([router.abort_comm.remote for router in self.group_routers()] +
                             [self.workers[index].reset_comms.remote for index in members])
        self._phase("stopped")

    def _covered_without(self, lost: list[int]) -> bool:
        """Every logical expert of every layer still has a slot on a worker not in ``lost``."""
        table = self.placement
        alive = [s for s in range(table.num_slots) if s // table.slots_per_worker not in lost]
        return all(set(table.phy2log[layer, alive].tolist()) >= set(range(table.num_experts))
                   for layer in range(table.num_layers))

    def _serve_on_replicas(self, lost: list[int], restarted: list[int], started: float) -> int:
        """Keep serving at once: the survivors' replicas take the lost workers' tokens.

        The lost workers' slots become empty in a new epoch, the groups are rebuilt over the
        survivors only, and a background thread re-includes the workers once Ray has
        restarted them (their experts come back from the checkpoint).
        """
        current = self.placement
        phy2log = current.phy2log.copy()
        for index in lost:
            phy2log[:, current.worker_slots(index)] = -1
        degraded = self._new_table(phy2log)
        survivors = [w for w in range(len(self.workers)) if w not in lost]
        self._switch_groups(degraded, current.epoch, survivors, survivors, fault_point="recovery_switch")
        self.placement = degraded
        self.degraded = {"lost": lost, "rows": current.phy2log.copy(), "since": time.time(), "attempts": 0,
                         "last_error": None, "next_attempt_at": None, "gave_up": False}
        self._count("recoveries_on_replicas")
        phases, self._phases = self._phases, None
        self.recoveries.append({"time": time.time(), "lost_workers": lost, "restarted_routers": [],
                                "mode": "replicas", "generation": self.generation,
                                "seconds": time.perf_counter() - started, "phases": phases})
        self._start_reinclude()
        return self.generation

    # ---- routers in the group ------------------------------------------------------------------
    def router_members(self) -> list[int]:
        """The routers in the expert-parallel group (indices): every one but those left out."""
        return [index for index in range(len(self.routers)) if index not in self.routers_out]

    def group_routers(self) -> list[Any]:
        return [self.routers[index] for index in self.router_members()]

    def _check_routers(self) -> tuple[list[int], list[int]]:
        """Step 3b of ``recover`` (recovery lock held): every router's state, before the group
        is rebuilt. One Ray calls alive, with the pid the controller knows, stays in. One that
        restarted and answers is given the supervisor and the placement in service and joins
        now. One that is dead or restarting, or silent for ``ROUTER_PING_TIMEOUT_S`` (frozen: the
        rank watch kills it) is left out: the other routers serve on at once, and
        ``_reinclude_routers`` brings it back once it answers again. Only when every router
        is lost does recovery wait for one here (a group needs a router). Returns the routers
        restarted and joining now, and those left out."""
        restarted, left_out = [], []
        for index, pid in sorted(self._router_pids(list(range(len(self.routers)))).items()):
            if pid is None:
                left_out.append(index)
            elif pid != self.router_pids[index]:
                self._readmit_router(index, pid)
                restarted.append(index)
        if len(left_out) == len(self.routers):  # nobody to serve: wait for the first one back
            index = left_out.pop(0)
            self._readmit_router(index, self._wait_restarted(self.routers[index]))
            restarted.append(index)
        self.routers_out = set(left_out)
        if left_out:
            self._count("routers_left_out")
            if self._router_thread is None or not self._router_thread.is_alive():
                self._router_thread = threading.Thread(target=self._reinclude_routers, name="raymoe-router-reinclude",
                                                       daemon=True)
                self._router_thread.start()
        return restarted, left_out

    def _router_pids(self, indices: list[int]) -> dict[int, int | None]:
        """Each router's pid if Ray calls it alive and it answers within
        ``ROUTER_PING_TIMEOUT_S`` (all asked at once); else None (left out for now)."""
        pids: dict[int, int | None] = {}
        asked = {}
        for index in indices:
            router = self.routers[index]
            if (self._rank_watch.written_off(f"router {index}")  # wedged (killed) or dead
                    or actor_table_entry(router._actor_id.hex()).get("State", "ALIVE") != "ALIVE"):
                pids[index] = None  # asking would wait for its restart
            else:
                asked[index] = router.info.remote()
        deadline = time.monotonic() + ROUTER_PING_TIMEOUT_S
        for index, answer in asked.items():
            try:
                pids[index] = ray.get(answer, timeout=max(0.0, deadline - time.monotonic()))["pid"]
            except (ray.exceptions.GetTimeoutError, *LOST):
                pids[index] = None
        return pids

    def _readmit_router(self, index: int, pid: int) -> None:
        """A restarted router (its requests moved to live routers) gets the supervisor and the
        placement in service; it joins with the next group."""
        router = self.routers[index]
        ray.get([router.set_supervisor.remote(ray.get_runtime_context().current_actor),
                 router.set_placement.remote(self.placement.to_dict())], timeout=CALL_TIMEOUT_S)
        self.router_pids[index] = pid
        self.cursors[index] = 0  # a new process counts its steps from 0
        getattr(self, "_autoscale_cursors", {}).pop(index, None)  # (the autoscaler's cursor: actors/autoscaler.py)

    def _reinclude_routers(self) -> None:
        """Bring the routers left out back into the group once Ray has restarted them: one
        rebuild for all that are back (the one pause of a re-include, as for workers). A
        failed attempt is counted and shown in status(), and tried again after a pause."""
        backoff = REINCLUDE_FIRST_BACKOFF_S
        while self.routers_out and not self._stopped.is_set():
            try:
                for index in sorted(self.routers_out):
                    self._wait_restarted(self.routers[index])
                with self._recover_lock:
                    back = []
                    for index, pid in sorted(self._router_pids(sorted(self.routers_out)).items()):
                        if pid is not None:
                            self._readmit_router(index, pid)
                            back.append(index)
                    if not back:  # e.g. the rank watch has not heard from the new incarnation yet
                        self._stopped.wait(0.25)
                        continue
                    started = time.perf_counter()
                    members = [w for w in range(len(self.workers))
                               if self.degraded is None or w not in self.degraded["lost"]]
                    self.routers_out -= set(back)
                    self._rebuild_groups(members)
                    self._count("router_reincludes")
                    self.recoveries.append({"time": time.time(), "reincluded_routers": back, "mode": "reinclude",
                                            "generation": self.generation,
                                            "seconds": time.perf_counter() - started})
                backoff = REINCLUDE_FIRST_BACKOFF_S
            except Exception as error:  # counted, shown in status(), tried again
                self._count("router_reinclude_failures")
                self.last = {"error": f"re-including routers {sorted(self.routers_out)} failed: "
                                      f"{type(error).__name__}: {error}", "time": time.time()}
                if self._stopped.wait(backoff):
                    return
                backoff = min(2 * backoff, REINCLUDE_MAX_BACKOFF_S)

    # ---- re-including restarted workers -------------------------------------------------------
    def _reinclude_running(self) -> bool:
        return self._reinclude_thread is not None and self._reinclude_thread.is_alive()

    def _start_reinclude(self) -> None:
        self.degraded.update(gave_up=False, next_attempt_at=time.time())
        self._reinclude_thread = threading.Thread(target=self._reinclude, name="raymoe-reinclude", daemon=True)
        self._reinclude_thread.start()

    def _reinclude(self) -> None:
        """Re-include the lost workers once they are back, retrying a failed attempt with
        exponential backoff, at most ``REINCLUDE_MAX_ATTEMPTS`` times. The replicas serve
        throughout; every attempt and failure is counted and the last error is in status()."""
        backoff = REINCLUDE_FIRST_BACKOFF_S
        for attempt in range(1, REINCLUDE_MAX_ATTEMPTS + 1):
            degraded = self.degraded
            if degraded is None or self._stopped.is_set():
                return
            self._count("reinclude_attempts")
            degraded["attempts"] += 1
            degraded["next_attempt_at"] = None
            try:
                self._reinclude_once()
                return
            except Exception as error:  # counted, shown in status(), and tried again after a pause
                self._count("reinclude_failures")
                message = f"re-including workers {degraded['lost']} failed (attempt {attempt} of " \
                          f"{REINCLUDE_MAX_ATTEMPTS}): {type(error).__name__}: {error}"
                degraded["last_error"] = message
                self.last = {"error": message, "time": time.time()}
            if attempt == REINCLUDE_MAX_ATTEMPTS:
                degraded.update(gave_up=True, next_attempt_at=None)
                return
            degraded["next_attempt_at"] = time.time() + backoff
            if self._stopped.wait(backoff):
                return
            backoff = min(2 * backoff, REINCLUDE_MAX_BACKOFF_S)

    def _reinclude_once(self) -> None:
        """One attempt: wait for the lost workers' restart, load the full placement into them,
        then switch everybody to it. A failure after the routers stopped rolls them back onto
        the replicas (the degraded placement, groups over the survivors) before it is raised,
        so requests wait a moment but are never lost."""
        lost = self.degraded["lost"]
        began = time.perf_counter()
        self._replace_dead_workers(lost)  # one Ray will not restart gets a new actor (actors/self_heal.py)
        pids = {index: self._wait_restarted(self.workers[index], self._restart_timeout_s(), self.killed_pids.get(index))
                for index in lost}
        for index in lost:
            self.killed_pids.pop(index, None)
        restart_wait_s = time.perf_counter() - began
        with self._recover_lock:
            if self.degraded is None:
                return
            started = time.perf_counter()
            self._phase_start, self._phases = started, []
            phases = self._phases
            current = self.placement
            restored = self._new_table(self.degraded["rows"])
            # a replaced worker's experts are copied from the survivors (actors/self_heal.py)
            seeded = self._seed_replacements(lost, current, restored)
            for index in lost:
                self.worker_pids[index] = pids[index]
                self._fault("reinclude_load")
                if index not in seeded:
                    self._reload(index, restored)
            self._phase("loaded")
            survivors = [w for w in range(len(self.workers)) if w not in lost]
            everyone = list(range(len(self.workers)))
            switch = "stop"
            try:
                if self._live_switch_backend():  # make-before-break: serving goes on while the group forms
                    self._activate(restored, current.epoch, survivors + seeded)
                    switch = self._switch_live_or_stop(restored, everyone, lost)
                    self._fault("reinclude_join")  # (tests) as if the new group failed once every rank is on it
                else:  # NCCL: every rank stops, joins, resumes
                    self._switch_groups(restored, current.epoch, survivors + seeded, everyone,
                                        fault_point="reinclude_join")
            except Exception:
                self._roll_back(restored, survivors)
                raise
            ray.get([self.workers[w].retire.remote(restored.epoch) for w in survivors + seeded],
                    timeout=CALL_TIMEOUT_S)
            self.placement = restored
            self.degraded = None
            self._count("reincludes")
            self._phase("retired")
            self._phases = None
            self.recoveries.append({"time": time.time(), "reincluded_workers": lost, "mode": "reinclude",
                                    "switch": switch, "generation": self.generation,
                                    "seconds": time.perf_counter() - started, "restart_wait_s": restart_wait_s,
                                    "phases": phases})

    # ---- make-before-break (the re-include's switch on the CPU transports) ----------------------
    def _live_switch_backend(self) -> bool:
        """Whether the groups' transport may form a new group beside the live one (sockets,
        gloo). Not NCCL: a communicator created beside live collectives can deadlock there
        (jax#11637), so NCCL groups are rebuilt with every rank stopped (``_switch_groups``)."""
        return CommBackend(self.groups["backend"]).resolve() in LIVE_SWITCH_BACKENDS

    def _switch_live_or_stop(self, table: PlacementTable, members: list[int], fresh: list[int]) -> str:
        """Serve ``table`` over a group of ``members`` (``fresh``: those serving no group now):
        formed beside the one in service and switched to at one step boundary
        (``_switch_live``); if that fails, every rank is stopped and the group rebuilt
        (``_stop_and_switch``). Returns which: ``"live"`` or ``"stop (live switch failed: ...)"``."""
        try:
            self._switch_live(table, members, fresh)
            return "live"
        except Exception as error:
            self._count("live_switch_failures")
            self.last = {"error": f"the live switch to epoch {table.epoch} failed ({_describe(error)}); "
                                  "stopping every rank to switch instead", "time": time.time()}
            self._stop_and_switch(table, members)
            return f"stop (live switch failed: {_describe(error)})"

    def _switch_live(self, table: PlacementTable, members: list[int], fresh: list[int]) -> None:
        """Make-before-break: every router and every worker of ``members`` joins a new group
        (generation + 1) beside the one in service, on its call threads, while the step loops
        go on serving; the restarted workers (``fresh``) loaded their experts and warmed up
        before (Ray's restart, ``_reload``), and the survivors activated ``table``'s epoch. Once
        every rank has joined, the routers get a switch mark (``Router.mark_migration``): they
        send it in an idle tick that all of them send in the same round, and right after that
        tick every router switches group and placement together and every serving worker
        switches group (it reads the mark in the tick, as for a queued copy:
        ``ExpertWorker.prepare_switch``); the fresh workers start serving the new group at
        once. No rank stops: the streams see one round without a step. Raises if any rank
        fails to join or to switch within ``LIVE_SWITCH_TIMEOUT_S``: the caller then stops
        every rank (``abort_comm``/``reset_comms`` also drop a prepared group)."""
        generation = self.generation + 1
        mark = switch_mark(table.epoch)  # above every copy's mark of this epoch
        routers = self.group_routers()
        backend, timeout_s, count = self.groups["backend"], self.groups["timeout_s"], len(routers)
        # A fresh worker's loop on a group it served before (a failed attempt's) ends now, not at its deadline.
        _until_available_all([self.workers[w].reset_comms.remote for w in fresh])
        rendezvous = ray.get(routers[0].rendezvous.remote(), timeout=CALL_TIMEOUT_S)
        placement = table.to_dict()
        _gather([router.prepare_switch.remote(rendezvous, generation, members, rank, count, placement)
                 for rank, router in enumerate(routers)] +
                [self.workers[w].prepare_switch.remote(backend, rendezvous, count + rank, count, members, timeout_s,
                                                       generation, mark)
                 for rank, w in enumerate(members)])
        self._phase("new group formed")
        if self._take_fault("reinclude_hold"):  # (tests) serving goes on over the old group meanwhile
            self._stopped.wait(REINCLUDE_HOLD_S)
        # Every rank has prepared: now the mark (no router may have it before every rank can switch).
        ray.get([router.mark_migration.remote(mark) for router in routers] +
                [self.workers[w].serve_pending.remote(generation) for w in fresh], timeout=CALL_TIMEOUT_S)
        self._phase("marked")
        switched = ray.get([router.wait_switched.remote(generation, LIVE_SWITCH_TIMEOUT_S) for router in routers] +
                           [self.workers[w].wait_switched.remote(generation, LIVE_SWITCH_TIMEOUT_S) for w in members],
                           timeout=LIVE_SWITCH_TIMEOUT_S + CALL_TIMEOUT_S)
        if not all(switched):
            late = [f"router {i}" for i, ok in zip(self.router_members(), switched) if not ok] + \
                   [f"worker {w}" for w, ok in zip(members, switched[count:]) if not ok]
            raise RuntimeError(f"{', '.join(late)} did not switch to generation {generation} within "
                               f"{LIVE_SWITCH_TIMEOUT_S:g} s of the mark")
        self._phase("switched")
        self.generation = generation
        if len(members) == len(self.workers):
            self._join_migration_group()  # at a step boundary the routers mark, as copies run
            self._phase("migration joined")

    def _phase(self, name: str) -> None:
        """A step of a recovery or re-include ended: its seconds since the lock was taken go in
        the record's ``phases``; a re-include's last step is also ``status()["degraded"]["phase"]``."""
        phases = self._phases
        if phases is not None:
            phases.append((name, round(time.perf_counter() - self._phase_start, 4)))
        degraded = self.degraded
        if degraded is not None and self._reinclude_thread is threading.current_thread():
            degraded["phase"] = name

    def _roll_back(self, attempted: PlacementTable, survivors: list[int]) -> None:
        """Back onto the replicas after a failed switch to ``attempted``: the degraded placement
        again, in a newer epoch (routers never go back to an older one), served by the
        survivors, with the groups rebuilt over them; older epochs are forgotten."""
        self._count("reinclude_rollbacks")
        rolled = self._new_table(self.placement.phy2log)
        self._switch_groups(rolled, self.placement.epoch, survivors, survivors)
        ray.get([self.workers[w].retire.remote(rolled.epoch) for w in survivors], timeout=CALL_TIMEOUT_S)
        self.placement = rolled

    def _wait_restarted(self, actor: Any, timeout_s: float = RESTART_TIMEOUT_S, killed_pid: int | None = None) -> int:
        """Wait until ``actor`` answers again; returns its pid. ``killed_pid``: the process this
        recovery killed, which does not count as back (a kill sent while its node was cut off
        lands only once the link is back, seconds later: re-included meanwhile, it would die
        again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid = ray.get(actor.info.remote(), timeout=PING_TIMEOUT_S)["pid"]
                if pid != killed_pid:
                    return pid
            except LOST:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"a lost actor did not restart within {timeout_s:.0f} s") from None
            time.sleep(0.5)

    def _restart_timeout_s(self) -> float:
        """A restarted worker answers once its constructor loaded its experts: the restart
        deadline plus one reload's."""
        return RESTART_TIMEOUT_S + reload_deadline_s(self.pool_bytes)

    def _reload(self, index: int, table: PlacementTable) -> dict[str, Any]:
        """Load ``table`` into restarted worker ``index``: a deadline from its pool's bytes,
        retried on a timeout (``retry_on_timeout``), waiting out further restarts meanwhile."""
        deadline_s = reload_deadline_s(self.pool_bytes)
        placement = table.to_dict()
        return retry_on_timeout(
            lambda: _until_available(lambda: self.workers[index].load_placement.remote(placement),
                                     call_timeout_s=deadline_s),
            what=f"loading the placement into worker {index} ({self.pool_bytes / 2**30:.2f} GiB pool, "
                 f"{deadline_s:.0f} s a try)",
            on_timeout=lambda error: self._count("reload_timeouts"))
