"""A rank's progress counter, readable without the rank's GIL or its Ray call path.

A router's step thread (every turn of its loop: an agreement round, a group step, a wait while
not joined) and an expert worker's serving thread (every MoE layer served, every idle tick)
add one to a counter in a small file in ``/dev/shm`` (``raymoe-progress-<pid>``), mapped into
the process: a store into shared memory, no system call per step. The controller's rank
watch (actors/rank_watch.py) reads it, with the process's state from ``/proc/<pid>/stat``, on
the rank's node, to tell a rank whose Ray calls go unanswered because the machine is
overloaded (its counter advances: ``busy``) from a frozen one (SIGSTOPped: state ``T``), a
hung one or one spinning with the GIL held (its counter stands still): only those are killed.

The file: 4 words of 8 bytes, native order: ``MAGIC``, the writer's pid, the counter, and the
node's ``CLOCK_MONOTONIC`` (ns) at the last tick. One reading thus says how long ago the counter
last advanced (``age_s``, reckoned on the rank's own node: no clocks are compared across
machines), where two readings would be needed to see it move: on a loaded node the watch's
reader (a SlotReader actor pinned to the rank's node) may answer only once within the limit.
A slot outlives a SIGKILLed process (tmpfs); each new slot removes the slots of processes that
no longer exist, and the watch removes the slot of a rank it killed.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Any

SLOT_DIR = "/dev/shm"
PREFIX = "raymoe-progress-"
MAGIC = 0x72_61_79_6D_6F_65_70_31  # "raymoep1"
WORDS = 4
SIZE = 8 * WORDS


def slot_path(pid: int, directory: str = SLOT_DIR) -> str:
    return os.path.join(directory, f"{PREFIX}{pid}")


def _sweep(directory: str) -> None:
    """Remove the slots of processes that are gone (a SIGKILLed rank leaves its slot)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
            continue
        pid = int(name[len(PREFIX):])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except OSError:  # alive, not ours to signal
            pass


class ProgressSlot:
    """This process's slot (writer side). ``tick()`` costs a Python store, no system call.
    Where the slot cannot be made (no /dev/shm), ``tick()`` does nothing and the watch judges
    the rank by its probe alone, as before the slot."""

    def __init__(self, directory: str = SLOT_DIR):
        self.path: str | None = None
        self.count = 0
        self._map: mmap.mmap | None = None
        self._words: Any = None
        try:
            _sweep(directory)
            path = slot_path(os.getpid(), directory)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, SIZE)
                self._map = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
            self._words = memoryview(self._map).cast("Q")
            self._words[1] = os.getpid()
            self._words[2] = 0
            self._words[3] = time.monotonic_ns()
            self._words[0] = MAGIC
            self.path = path
        except (OSError, ValueError):
            self._map, self._words = None, None

    def tick(self) -> None:
        """One more step (or turn) taken."""
        self.count += 1
        words = self._words
        if words is not None:
            words[2] = self.count
            words[3] = time.monotonic_ns()

    def close(self) -> None:
        words, self._words = self._words, None
        if words is not None:
            words.release()
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def read_slot(pid: int, directory: str = SLOT_DIR) -> int | None:
    """Rank ``pid``'s counter; None when it has no slot here (another node, no /dev/shm, not a
    rank) or the slot is not its own."""
    words = _read_words(pid, directory)
    return None if words is None else words[0]


def _read_words(pid: int, directory: str) -> tuple[int, int] | None:
    """(counter, monotonic ns of its last tick) of rank ``pid``'s slot, or None."""
    try:
        with open(slot_path(pid, directory), "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    magic, owner, counter, ticked_ns = struct.unpack(f"{WORDS}Q", data)
    if magic != MAGIC or owner != pid:
        return None
    return counter, ticked_ns


def remove_slot(pid: int, directory: str = SLOT_DIR) -> None:
    try:
        os.unlink(slot_path(pid, directory))
    except OSError:
        pass


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (R running, S sleeping, D disk wait, T stopped,
    t traced, Z zombie); None when there is no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rfind(b")")  # the command name may hold spaces and parentheses
    if end < 0 or end + 2 >= len(stat):
        return None
    return chr(stat[end + 2])


def sample_progress(pid: int, directory: str = SLOT_DIR) -> dict[str, Any]:
    """What the watch reads of a rank on this node: its process state, its counter and how long
    ago (seconds, this node's clock) the counter last advanced."""
    state = process_state(pid)
    words = _read_words(pid, directory)
    if words is None:
        return {"state": state, "counter": None, "age_s": None}
    counter, ticked_ns = words
    age_s = max(0.0, (time.monotonic_ns() - ticked_ns) / 1e9) if ticked_ns else None
    return {"state": state, "counter": counter, "age_s": age_s}


class SlotReader:
    """Reads the progress slots of the ranks on its node, for a rank watch on another node: one
    per node, a Ray actor (``num_cpus=0``) pinned there. An actor, not a task per reading: a task
    needs a worker process leased (on a loaded node, often a new one started: seconds), the very
    moment the watch needs the reading; an idle actor's call does not."""

    def sample(self, pid: int) -> dict[str, Any]:
        return sample_progress(pid)
