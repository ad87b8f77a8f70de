"""Wedged ranks: a router or expert worker that Ray still calls alive but that makes no progress
(SIGSTOPped, stuck with the GIL held, its process hung) is found within the exchange deadline
and handed to recovery as a dead one; one whose calls go unanswered while it steps (an
overloaded machine) is ``busy``, reported and not killed.

The controller (actors/recovery.py's :class:`Recovery` mixes :class:`RankWatching` in, so
``rank_states`` is one of the controller actor's calls) runs one thread that probes every rank
each ``PROBE_INTERVAL_S``, at most one probe per rank in flight, with calls that cost the rank
next to nothing: a router's ``expert_loads_since`` past its last step (its progress counter: the
group steps it took, a number and an empty array) and ``num_unfinished`` (its requests in
flight); a worker's ``ready``, and every ``PROGRESS_EVERY``-th time its ``info`` (its progress
counter, ``steps_served``; ``info`` reads the process's memory maps, so not 4 times a second).
(A router's ``get_telemetry`` copies its 1,000-step ring: 33 ms of its GIL, too dear to poll.)
Each rank's progress time is when its counter last advanced (the controller's clock: no clocks
are compared across machines). Per rank, one of:

- ``serving``: it answers and its counter advanced within the deadline;
- ``alive``: it answers and the deployment has nothing to do;
- ``stalled``: it answers, the routers hold requests, and its counter has not moved for longer
  than the deadline (reported, never acted on: in a lockstep group every rank stalls when one
  fails, and the exchange's own deadline and recovery handle a peer that stops answering there);
- ``busy``: Ray's actor table says ALIVE and a probe has had no answer for ``comm.wedge_after_s``
  (below), but the rank's progress slot advanced within that limit: its step thread steps, only
  its calls are starved (a load spike on its machine: the probe needs its call thread and its
  GIL), or, for a rank on another node, no reading recent enough to tell has come back
  (undecided). Reported with the reason, and not killed: under overload a kill turns a spike into a
  restart storm. It is killed all the same (as ``wedged``) once its probe has gone unanswered
  for ``BUSY_BOUND_FACTOR`` (5) times the limit (50 s at the defaults): a rank whose calls stay
  unanswered that long cannot take requests, aborts or recovery's calls;
- ``wedged``: Ray's actor table says ALIVE (this incarnation for longer than the limit), a probe
  has had no answer for ``comm.wedge_after_s`` (default 0.8 x ``comm.timeout_s``, at most 10 s:
  cluster/config.py), and the rank is not busy: its process is stopped (``T``/``t`` in
  ``/proc/<pid>/stat``), its progress counter has not advanced within the limit (hung, in a call
  or a collective; spinning with the GIL held: a reading shows it standing still for the whole
  limit), or, on the watch's node, it has no slot to read. The rank is killed
  at once (``ray.kill``, Ray restarts it: ``max_restarts=-1``), so it cannot come back half-way,
  and recovery starts at once (the other ranks need not wait out their exchange deadline),
  treating it as a dead one: a router's requests move to a live router
  (actors/router_relay.py), a worker's experts are served from replicas or reloaded;
- ``dead``: Ray reports it dead or restarting, or a probe failed with an actor error.

The progress slot (actors/progress_slot.py) is a counter each rank's step or serving thread
bumps in ``/dev/shm`` every turn (a router: every turn of its step loop, idle rounds too; a
worker: every layer served and every idle tick), with the node's monotonic time of the bump: one
reading says how long ago the counter last advanced (reckoned on the rank's node). For a rank on
the watch's own node it is read, with the process state, every round; for a rank on another node,
by that node's ``SlotReader`` (an actor pinned there with ``NodeAffinitySchedulingStrategy``,
started as soon as the watch learns of a rank there, ended once no rank runs there: an actor,
even one without CPUs, keeps Ray's autoscaler from removing its node), one reading in flight,
only while the rank's probe has gone unanswered for a third of the limit. A rank is wedged only on evidence: a stopped
process, or a reading showing its counter stood still for the whole limit. A rank on another node
whose readings have not come back (its node too loaded even for the reader) or whose last reading
is too old to tell is undecided: reported ``busy`` and not killed before the busy bound. (CI,
stops 40 and 41: on the loaded 2-core machine the pinned reading of a stepping router came back
late or not at all within the limit, and the watch, taking no news as a standing counter, killed
it.) A rank on this node without a slot (no ``/dev/shm``) is judged by its probe alone: wedged.

``rank_states()`` returns every rank's row (state, reason, last progress time, seconds since it,
its process state, its slot's counter and the seconds since it advanced), the wedged ranks found
so far (``wedged``: rank, pid, reason with the evidence, seconds its probe went unanswered, the
time of the kill) and the busy ones spared (``spared``: rank, pid, reason, when first found busy
in each episode). ``raymoe status`` shows each rank's state and reason; so does the ingress'
``/health`` (actors/ingress.py), which also asks each actor itself and calls one that is silent
for 5 s ``unresponsive`` before the watch's limit has passed (a rank the watch finds busy keeps
the watch's row, with its reason). Only ``serving`` and ``alive`` are healthy.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import ray

from raymoe.actors.progress_slot import SlotReader, remove_slot, sample_progress

PROBE_INTERVAL_S = 0.25  # how often every rank is probed (one probe per rank in flight)
PROGRESS_EVERY = 4  # a worker's probe is its `info` (steps served) every this many probes
NO_STEP = 2**62  # expert_loads_since(NO_STEP): no loads, only the router's step count
WEDGE_FRACTION = 0.8  # without comm.wedge_after_s from deploy: this much of comm.timeout_s
DEFAULT_DEADLINE_S = 30.0  # comm.timeout_s when the controller was given no groups
GCS_TIMEOUT_S = 2.0
WEDGED_KEPT = 32  # wedged ranks remembered for rank_states()
BUSY_BOUND_FACTOR = 5  # a busy rank (calls unanswered, counter advancing) is killed after this many limits
REMOTE_SAMPLE_AFTER = 1 / 3  # a rank on another node: its counter is read (its node's SlotReader) from this much of the limit
STOPPED = frozenset({"T", "t"})  # /proc/<pid>/stat: stopped by a signal, or by a tracer
STATES = ("serving", "alive", "stalled", "busy", "wedged", "dead")
HEALTHY = frozenset({"serving", "alive"})  # any other state makes /health answer 503


class RankRecord:
    """What the watch knows of one rank (one actor handle)."""

    def __init__(self, name: str, kind: str, actor: Any):
        self.name, self.kind, self.actor = name, kind, actor
        self.actor_id = actor._actor_id.hex()
        self.pending: list[tuple[str, Any]] | None = None  # the probe in flight: (what, ref) pairs
        self.probes = 0  # probes sent to this incarnation
        self.asked_at = 0.0
        self.answered_at: float | None = None  # monotonic
        self.counter: int | None = None
        self.progress_at: float | None = None  # monotonic: when the counter last advanced
        self.progress_wall: float | None = None  # the same, wall clock (for reports)
        self.has_work = False
        self.first_answer_at: float | None = None  # monotonic: this incarnation's first answer
        self.pid: int | None = None
        self.process: tuple[str, int] | None = None  # (node id, pid) of this incarnation, from Ray's actor table
        self.ray_state = "ALIVE"
        self.incarnation: int | None = None  # Ray's NumRestarts
        self.alive_since = time.monotonic()
        self.killed_incarnation: int | None = None
        self.state, self.reason = "alive", ""
        # Its progress slot (actors/progress_slot.py), read without its GIL or its Ray calls: on
        # this node every round, on another one by its node's SlotReader while its probe is unanswered.
        self.slot_pid: int | None = None  # the process the readings below are of
        self.slot_counter: int | None = None
        self.slot_progress_at: float | None = None  # monotonic: when the watch saw the counter advance
        self.slot_read_at: float | None = None  # monotonic: the last reading
        self.slot_still_s: float | None = None  # at the last reading: how long the counter had stood still
        self.slot_counter_seen_at: float | None = None  # monotonic: the first reading of its current value
        self.proc_state: str | None = None  # /proc/<pid>/stat's state letter at the last reading
        self.sample_ref: Any = None  # a reading in flight (a rank on another node: its node's SlotReader)
        self.busy_since: float | None = None  # monotonic: when it was first found busy (this silence)


def actor_table_entry(actor_id: str) -> dict[str, Any]:
    """Ray's actor table row of ``actor_id`` (State, NumRestarts; {} when unknown)."""
    from ray._private.state import actors

    try:
        return actors(actor_id=actor_id) or {}
    except Exception:  # the GCS is slow or gone: nothing known this round
        return {}


def sigkill(pid: int) -> bool:
    """SIGKILL ``pid`` if it is a Ray worker process (its title starts ``ray::``; not a pid reused
    since); whether a signal was sent."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::"):
                return False
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:  # gone already, or not ours to signal
        return False


def sigkill_on_node(node_id: str, pid: int) -> None:
    """``sigkill(pid)`` on node ``node_id``: here if it is this process's node, else in a task
    pinned there (not waited for)."""
    if node_id == ray.get_runtime_context().get_node_id():
        sigkill(pid)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        ray.remote(num_cpus=0, max_retries=0)(sigkill).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid)
    except Exception:  # the node is gone: so is the process
        pass


class RankWatch:
    """The watch thread over ``host.routers`` and ``host.workers`` (read every round: a resize
    may change them), with ``host.groups["timeout_s"]`` as the deadline."""

    def __init__(self, host: Any, interval_s: float = PROBE_INTERVAL_S):
        self.host, self.interval_s = host, interval_s
        self.records: dict[str, RankRecord] = {}
        self.wedged: list[dict[str, Any]] = []
        self.spared: list[dict[str, Any]] = []  # busy ranks not killed: each time one was found busy
        self._node_id: str | None = None
        self._readers: dict[str, Any] = {}  # node id -> its SlotReader actor (ranks on other nodes)
        self._reader_class: Any = None
        self.last_error: str | None = None  # the last round's failure, if any
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="raymoe-rank-watch", daemon=True)
        self._thread.start()

    # ---- the thread -----------------------------------------------------------------------
    def deadline_s(self) -> float:
        groups = getattr(self.host, "groups", None) or {}
        return float(groups.get("timeout_s") or DEFAULT_DEADLINE_S)

    def wedge_after_s(self) -> float:
        """comm.wedge_after_s as deploy resolved it (cluster/config.py), else the fraction."""
        groups = getattr(self.host, "groups", None) or {}
        return float(groups.get("wedge_after_s") or WEDGE_FRACTION * self.deadline_s())

    def busy_bound_s(self) -> float:
        """How long a busy rank's calls may go unanswered before it is killed all the same."""
        return BUSY_BOUND_FACTOR * self.wedge_after_s()

    def node_id(self) -> str:
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    def _stopped(self) -> bool:
        stopped = getattr(self.host, "_stopped", None)
        return stopped is not None and stopped.is_set()

    def _run(self) -> None:
        while getattr(self.host, "workers", None) is None or getattr(self.host, "routers", None) is None:
            time.sleep(0.1)  # the controller's constructor is still running
        while not self._stopped():
            started = time.monotonic()
            try:
                self.round()
            except Exception as error:  # keep watching; the next round starts afresh
                self.last_error = f"{type(error).__name__}: {error}"
            time.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _ranks(self) -> list[tuple[str, str, Any]]:
        return [*((f"router {i}", "router", a) for i, a in enumerate(list(self.host.routers))),
                *((f"worker {i}", "worker", a) for i, a in enumerate(list(self.host.workers)))]

    def round(self) -> None:
        """Probe every rank, read the answers that came, and judge each rank."""
        ranks = self._ranks()
        with self._lock:
            for name, kind, actor in ranks:
                record = self.records.get(name)
                if record is None or record.actor_id != actor._actor_id.hex():
                    self.records[name] = RankRecord(name, kind, actor)
            for name in set(self.records) - {name for name, _, _ in ranks}:
                del self.records[name]
            records = list(self.records.values())
        now = time.monotonic()
        for record in records:
            if record.pending is None:
                record.pending, record.asked_at = self._probe(record), now
        refs = [ref for r in records for _, ref in r.pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.interval_s)
        ready = set(ready)
        for record in records:
            if all(ref in ready for _, ref in record.pending):
                self._answered(record)
        work = any(r.has_work for r in records if r.kind == "router")
        deadline = self.deadline_s()
        for record in records:
            self._judge(record, work, deadline)
        self._end_idle_readers(records)

    @staticmethod
    def _probe(record: RankRecord) -> list[tuple[str, Any]]:
        record.probes += 1
        if record.kind == "router":
            return [("steps", record.actor.expert_loads_since.remote(NO_STEP)),
                    ("unfinished", record.actor.num_unfinished.remote())]
        if record.probes % PROGRESS_EVERY == 1:
            return [("info", record.actor.info.remote())]
        return [("ready", record.actor.ready.remote())]

    def _answered(self, record: RankRecord) -> None:
        pending, record.pending = record.pending, None
        now = time.monotonic()
        try:
            answers = {what: ray.get(ref, timeout=0) for what, ref in pending}
        except ray.exceptions.RayError as error:
            record.state = "dead"
            record.reason = f"{type(error).__name__}: {(str(error).strip() or 'no detail').splitlines()[0]}"[:300]
            record.answered_at = None
            return
        record.answered_at = now
        if record.first_answer_at is None:
            record.first_answer_at = now
        if "unfinished" in answers:
            record.has_work = answers["unfinished"] > 0
        if "steps" in answers:  # a router: the group steps it took
            counter = int(answers["steps"][0])
        elif "info" in answers:  # a worker: the steps it served
            counter = int(answers["info"].get("steps_served", 0))
            record.pid = answers["info"].get("pid", record.pid)
        else:  # liveness only
            return
        if record.counter is not None and counter != record.counter:  # it advanced since the last answer
            record.progress_at, record.progress_wall = now, time.time()
        record.counter = counter

    def _judge(self, record: RankRecord, work: bool, deadline: float) -> None:
        now = time.monotonic()
        entry = actor_table_entry(record.actor_id)
        state, incarnation = entry.get("State", record.ray_state), entry.get("NumRestarts", record.incarnation)
        if incarnation != record.incarnation or (state == "ALIVE") != (record.ray_state == "ALIVE"):
            record.alive_since = now  # a new incarnation, or alive again: its clock starts now
            if incarnation != record.incarnation and record.incarnation is not None:
                record.pending, record.counter, record.answered_at, record.pid = None, None, None, None
                record.first_answer_at, record.progress_at, record.probes = None, None, 0
        record.ray_state, record.incarnation = state, incarnation
        if entry.get("Pid") and (entry.get("Address") or {}).get("NodeID"):
            record.process = (entry["Address"]["NodeID"], int(entry["Pid"]))
            if record.process[0] != self.node_id():
                self._reader(record.process[0])  # up before a silence needs it
        if state != "ALIVE":
            record.state, record.reason = "dead", f"Ray reports the actor {state.lower()}"
            record.pending = None  # asked again once it is back
            return
        silent = now - record.asked_at if record.pending is not None else 0.0
        limit = self.wedge_after_s()
        self._read_progress(record, now, silent, limit)
        if record.pending is not None and silent > limit and now - record.alive_since > limit:
            verdict, why = self._verdict(record, now, silent, limit)
            if verdict == "busy":
                record.state, record.reason = "busy", why
                if record.busy_since is None:  # a new episode: remembered for rank_states()
                    record.busy_since = now
                    with self._lock:
                        self.spared.append({"rank": record.name, "pid": record.pid or self._pid(record),
                                            "reason": why, "silent_s": round(silent, 3), "time": time.time()})
                        del self.spared[:-WEDGED_KEPT]
                return
            record.state = "wedged"
            record.reason = (f"alive (Ray) but no answer to a progress probe for {silent:.1f} s "
                             f"(limit {limit:.1f} s, comm.wedge_after_s), and {why}")
            if record.killed_incarnation != incarnation:
                self._kill(record, silent)
            return
        record.busy_since = None
        if record.answered_at is None:
            return  # not heard from yet (its first probe is in flight): keep the last state
        since = now - (record.progress_at or record.first_answer_at or now)
        if work and since > deadline:
            record.state = "stalled"
            record.reason = f"answers, but no progress for {since:.1f} s while requests are in flight"
        elif record.progress_at is not None and now - record.progress_at <= deadline:
            record.state, record.reason = "serving", ""
        else:
            record.state, record.reason = "alive", ""

    @staticmethod
    def _pid(record: RankRecord) -> int | None:
        return None if record.process is None else record.process[1]

    def _read_progress(self, record: RankRecord, now: float, silent: float, limit: float) -> None:
        """Read the rank's progress slot and process state (actors/progress_slot.py): every round
        for a rank on this node; for one on another node, through that node's SlotReader, only
        while its probe has gone unanswered for REMOTE_SAMPLE_AFTER of the limit (one in flight)."""
        if record.process is None:
            return
        node, pid = record.process
        if pid != record.slot_pid:  # a new process (incarnation): no readings of it yet
            record.slot_pid, record.sample_ref = pid, None
            self._forget_readings(record)
        if node == self.node_id():
            self._apply_sample(record, now, sample_progress(pid))
            return
        if record.sample_ref is not None and ray.wait([record.sample_ref], timeout=0)[0]:
            ref, record.sample_ref = record.sample_ref, None
            try:
                self._apply_sample(record, now, ray.get(ref, timeout=0))
            except Exception:  # the reader (or its node) failed: no reading this time, a new reader next
                self._readers.pop(node, None)
        if record.pending is None:  # answered: the next silence reads afresh (no stale baseline)
            record.sample_ref = None
            self._forget_readings(record)
            return
        if record.sample_ref is None and silent >= REMOTE_SAMPLE_AFTER * limit:
            reader = self._reader(node)
            try:
                record.sample_ref = None if reader is None else reader.sample.remote(pid)
            except Exception:  # the reader is gone: the verdict goes without a reading this time
                self._readers.pop(node, None)
                record.sample_ref = None

    def _reader(self, node: str) -> Any:
        """Node ``node``'s SlotReader, started on first need (None if it cannot be: the node is gone).
        The watch starts one as soon as it learns a rank runs on another node, so that it is up
        before a silence needs it."""
        reader = self._readers.get(node)
        if reader is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            if self._reader_class is None:  # made once (each ray.remote of a class is exported anew)
                self._reader_class = ray.remote(num_cpus=0, max_restarts=0)(SlotReader)
            try:
                reader = self._reader_class.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            except Exception:
                return None
            self._readers[node] = reader
        return reader

    def _end_idle_readers(self, records: list[RankRecord]) -> None:
        """End the SlotReaders of nodes no rank runs on any more (after a shrink, or a rank
        restarted elsewhere). An actor keeps its node from counting idle even with num_cpus=0, so
        a reader left behind would keep Ray's autoscaler from ever removing the node (seen in CI:
        the expert nodes a shrink freed stayed up)."""
        used = {record.process[0] for record in records if record.process is not None}
        for node in [node for node in self._readers if node not in used]:
            reader = self._readers.pop(node)
            try:
                ray.kill(reader, no_restart=True)
            except Exception:  # gone already, with its node
                pass

    @staticmethod
    def _forget_readings(record: RankRecord) -> None:
        record.slot_counter, record.slot_progress_at, record.slot_read_at = None, None, None
        record.slot_still_s, record.slot_counter_seen_at, record.proc_state = None, None, None

    @staticmethod
    def _apply_sample(record: RankRecord, now: float, sample: dict[str, Any]) -> None:
        """One reading, collected at ``now``. It says what the counter is and how long it had
        stood still when read (``age_s``, on the rank's own node); without ``age_s`` the time
        between the first and the last reading of the same value says it."""
        record.slot_read_at, record.proc_state = now, sample.get("state")
        counter = sample.get("counter")
        if counter is None:
            return
        moved = record.slot_counter is not None and counter != record.slot_counter
        if moved or record.slot_counter is None:
            record.slot_counter_seen_at = now
        advanced_at = now if moved else None
        if sample.get("age_s") is not None:
            advanced_at = max(advanced_at or 0.0, now - sample["age_s"])
            record.slot_still_s = sample["age_s"]
        else:
            record.slot_still_s = now - record.slot_counter_seen_at
        if advanced_at is not None and (record.slot_progress_at is None or advanced_at > record.slot_progress_at):
            record.slot_progress_at = advanced_at
        record.slot_counter = counter

    def _verdict(self, record: RankRecord, now: float, silent: float, limit: float) -> tuple[str, str]:
        """("busy" or "wedged", why) for a rank whose probe has gone unanswered past the limit.

        Wedged only on evidence: its process is stopped; a reading shows its counter stood still
        for the whole limit; or, on this node, it has no slot to read (judged by its probe alone).
        Busy when its counter advanced within the limit. A rank on another node whose readings
        have not come back (that node is loaded too) or whose last reading is too old to tell is
        undecided: reported busy, not killed. Either way it is killed once its calls have gone
        unanswered for the busy bound: then it cannot take requests or recovery's calls."""
        if record.proc_state in STOPPED:
            return "wedged", f"its process is stopped (state {record.proc_state} in /proc/<pid>/stat)"
        remote = record.process is not None and record.process[0] != self.node_id()
        if record.slot_counter is None and not remote:
            return "wedged", "its progress counter could not be read (no progress slot readable)"
        bound = self.busy_bound_s()
        if record.slot_counter is not None and record.slot_still_s is not None and record.slot_still_s >= limit:
            read_ago = now - (record.slot_read_at or now)
            stale = f", read {read_ago:.1f} s ago" if read_ago >= 0.05 else ""
            return "wedged", (f"its progress counter has not advanced for {record.slot_still_s:.1f} s{stale} "
                              f"(process state {record.proc_state or 'unknown'})")
        since = None if record.slot_progress_at is None else now - record.slot_progress_at
        if since is not None and since <= limit:
            evidence = (f"its progress counter advanced {since:.1f} s ago (read outside its calls): stepping on "
                        f"an overloaded machine")
        elif record.slot_counter is None:
            evidence = "no reading of its progress counter has come back from its node yet (loaded too): undecided"
        else:
            evidence = (f"its last reading of its progress counter ({now - (record.slot_read_at or now):.1f} s ago) "
                        f"showed it advancing {record.slot_still_s or 0.0:.1f} s before; no newer reading has come "
                        f"back from its node (loaded too): undecided")
        if silent > bound:
            return "wedged", (f"{evidence}, but its calls have gone unanswered for longer than {bound:.1f} s "
                              f"({BUSY_BOUND_FACTOR} x the limit): it cannot take requests or recovery's calls")
        return "busy", (f"no answer to a progress probe for {silent:.1f} s (limit {limit:.1f} s), but {evidence}, "
                        f"not killed; killed if its calls stay unanswered for {bound:.1f} s")

    def _kill(self, record: RankRecord, silent: float) -> None:
        """A wedged rank is killed (Ray restarts it), so that recovery handles it as a dead one."""
        record.killed_incarnation = record.incarnation
        try:
            ray.kill(record.actor, no_restart=False)
            outcome = "killed; Ray restarts it and recovery takes it as a dead rank"
        except Exception as error:
            outcome = f"kill failed: {type(error).__name__}: {error}"
        if record.process is not None:
            # ray.kill asks the process itself to exit first, which a frozen one cannot do: Ray
            # ends it seconds later (measured 6 s), and until then its streams cannot move. A
            # SIGKILL on its node ends it now.
            sigkill_on_node(*record.process)
            if record.process[0] == self.node_id():
                remove_slot(record.process[1])  # (one on another node goes with the next sweep there)
        record.reason += f"; {outcome}"
        with self._lock:
            self.wedged.append({"rank": record.name, "pid": record.pid or self._pid(record), "reason": record.reason,
                                "silent_s": round(silent, 3), "time": time.time()})
            del self.wedged[:-WEDGED_KEPT]
        # Recovery now, not when the others' exchange deadline passes (a transport such as gloo
        # does not see the killed peer go): it leaves a lost router out, aborts the routers'
        # communicators (their steps run again on the new group) and rebuilds it.
        recover = getattr(self.host, "recover", None)
        if recover is not None:
            threading.Thread(target=self._recover, args=(recover, self.host.generation),
                             name="raymoe-watch-recover", daemon=True).start()

    def _recover(self, recover: Any, generation: int) -> None:
        try:
            recover(generation)
        except Exception as error:  # recovery reports its own failures (status); the watch goes on
            self.last_error = f"recovery after a kill: {type(error).__name__}: {error}"

    def is_wedged(self, name: str) -> bool:
        """Whether the watch found rank ``name`` ("worker 1") wedged and killed it (until its
        next incarnation answers)."""
        record = self.records.get(name)
        return record is not None and record.state == "wedged"

    def written_off(self, name: str) -> bool:
        """Whether the watch found rank ``name`` ("router 0") wedged (and killed it) or dead."""
        record = self.records.get(name)
        return record is not None and record.state in ("wedged", "dead")

    # ---- the report -------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        with self._lock:
            records = list(self.records.values())
            wedged = list(self.wedged)
            spared = list(self.spared)
        ranks = []
        for record in records:
            ranks.append({
                "rank": record.name, "state": record.state, "reason": record.reason,
                "pid": record.pid or self._pid(record),
                "last_progress_time": record.progress_wall,
                "since_progress_s": None if record.progress_at is None else round(now - record.progress_at, 3),
                "since_answer_s": None if record.answered_at is None else round(now - record.answered_at, 3),
                "progress": record.counter,
                "process_state": record.proc_state,
                "slot_progress": record.slot_counter,  # its progress slot's counter (loop turns)
                "since_slot_progress_s": None if record.slot_progress_at is None
                else round(now - record.slot_progress_at, 3),
            })
        return {"time": wall, "deadline_s": self.deadline_s(), "wedge_after_s": self.wedge_after_s(),
                "busy_bound_s": self.busy_bound_s(), "ranks": ranks, "wedged": wedged, "spared": spared,
                "watch_error": self.last_error}


class RankWatching:
    """The controller's side (mixed into actors/recovery.py's ``Recovery``): the watch starts
    with the controller and ``rank_states`` reports it."""

    def _init_rank_watch(self) -> None:
        self._rank_watch = RankWatch(self)

    def rank_states(self) -> dict[str, Any]:
        """Every router's and worker's state (module docstring) and the wedged ranks found."""
        return self._rank_watch.report()
