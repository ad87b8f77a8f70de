"""Runs one program as N ranks, each in its own spawned process, with bounded waits.

A rank program is a module-level function `program(rank, world_size, *args)` returning
something picklable. Its result, or the exception it raised, comes back to the test
process through a queue. Every wait is bounded; a rank that does not finish in time is
killed (by its own PID, never by name) and reported as such, so a hung collective fails
the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

EXIT_GRACE_S = 10.0  # how long a rank that reported may take to exit


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # formatted traceback when the program raised
    exit_code: int | None = None  # None: it did not exit in time and was killed
    reported: bool = False


def _rank_main(program: Callable, rank: int, world_size: int, args: tuple, results) -> None:
    try:
        payload = pickle.dumps((rank, program(rank, world_size, *args), None))
    except BaseException:  # report everything, including KeyboardInterrupt-like exits
        payload = pickle.dumps((rank, None, traceback.format_exc()))
    # Plain pickle bytes: tensors travel by value, not as shared-memory handles that
    # would die with this process.
    results.put(payload)


def run_ranks(
    program: Callable,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 60.0,
    silent_ranks: tuple[int, ...] = (),
) -> list[RankResult]:
    """Runs `program` on ranks 0..world_size-1 and returns their results in rank order.

    `silent_ranks` are not expected to report (e.g. a rank that stops itself); the harness
    waits for the others only, then kills the silent ones.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(program, rank, world_size, args, results), daemon=True)
        for rank in range(world_size)
    ]
    outcome = [RankResult(rank) for rank in range(world_size)]
    expected = world_size - len(silent_ranks)
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.start()
        for _ in range(expected):
            try:
                payload = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            rank, value, error = pickle.loads(payload)
            outcome[rank].value, outcome[rank].error, outcome[rank].reported = value, error, True
        exit_deadline = time.monotonic() + EXIT_GRACE_S
        for rank, process in enumerate(processes):
            if rank in silent_ranks:
                continue
            process.join(max(0.0, exit_deadline - time.monotonic()))
    finally:
        for rank, process in enumerate(processes):
            if process.is_alive():
                process.kill()  # SIGKILL to this child's own PID (also wakes a stopped one)
                process.join(5.0)
            else:
                outcome[rank].exit_code = process.exitcode
        results.close()
    return outcome


def values(outcome: list[RankResult]) -> list[Any]:
    """The ranks' return values; fails with every rank's traceback if any rank failed."""
    problems = []
    for result in outcome:
        if result.error is not None:
            problems.append(f"rank {result.rank} raised:\n{result.error}")
        elif not result.reported:
            problems.append(f"rank {result.rank} did not report (exit code {result.exit_code})")
    if problems:
        raise AssertionError("\n".join(problems))
    return [result.value for result in outcome]
