"""cluster/procfs.py's CPU time of a process: what benchmarks/cpu_by_process.py, bench_gc_freeze.py and
bench_ingress_loop.py report is user plus system time from stat, in seconds."""

import os
import time

from raymoe.cluster import procfs


def test_cpu_seconds_counts_what_this_process_burns_and_nothing_while_it_sleeps():
    before = procfs.cpu_seconds(procfs.stat(os.getpid()))
    started = time.process_time()
    while time.process_time() - started < 0.5:  # bounded: half a second of CPU
        sum(range(1000))
    burned = procfs.cpu_seconds(procfs.stat(os.getpid())) - before
    assert 0.4 <= burned <= time.process_time() - started + 0.1  # stat counts in ticks of 10 ms
    resting = procfs.cpu_seconds(procfs.stat(os.getpid()))
    time.sleep(0.3)
    assert procfs.cpu_seconds(procfs.stat(os.getpid())) - resting < 0.1
