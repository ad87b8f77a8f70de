"""Queue time and preemption counts for /metrics: the scheduler's bookkeeping, no model."""

from __future__ import annotations

import time

from raymoe.engine.block_manager import BlockManager
from raymoe.engine.latency_histogram import LatencyHistogram
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import Scheduler, SchedulerConfig
from raymoe.engine.sequence import Sequence


def test_histogram_buckets_are_upper_inclusive_like_prometheus():
    histogram = LatencyHistogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot["counts"] == [2, 2, 1]  # (.., 0.1], (0.1, 1.0], (1.0, +Inf)
    assert snapshot["sum"] == 0.05 + 0.1 + 0.5 + 1.0 + 7.0
    assert snapshot["bounds"] == [0.1, 1.0]


def test_queue_time_is_observed_once_per_sequence_at_its_first_admission():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(16, 4), token_budget=64)
    first, second = (Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), None, i) for i in range(2))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule().sequences == [first]  # one place in the batch: the second waits
    assert first.queue_time is not None and second.queue_time is None
    time.sleep(0.05)
    scheduler.finish(first)
    assert scheduler.schedule().sequences == [second]
    assert second.queue_time >= 0.05 > first.queue_time
    scheduler.free_blocks(16)  # preempts the second: back to the queue, then readmitted
    assert scheduler.num_preemptions == 1 and second.num_preemptions == 1
    assert scheduler.schedule().sequences == [second]
    snapshot = scheduler.queue_times.snapshot()
    assert sum(snapshot["counts"]) == 2  # the readmission is no new wait
    assert abs(snapshot["sum"] - (first.queue_time + second.queue_time)) < 1e-9
