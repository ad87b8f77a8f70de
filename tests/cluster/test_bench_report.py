"""`raymoe bench` statistics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from raymoe.cluster.bench_report import (
    RequestResult,
    comparison_table,
    format_summary,
    meets_slo,
    percentile,
    summarize,
    throughput_timeline,
)


def request(sent, chunks, done, tokens=None, error=None):
    return RequestResult(prompt_tokens=5, max_tokens=len(chunks), sent_s=sent, chunk_times_s=list(chunks),
                         output_tokens=len(chunks) if tokens is None else tokens, done_s=done, error=error)


@pytest.mark.parametrize("values, q, expected", [
    ([1, 2, 3, 4], 50, 2.5),
    ([1, 2, 3, 4], 95, 3.85),     # rank 0.95 * 3 = 2.85: 3 + 0.85 * (4 - 3)
    ([1, 2, 3, 4], 99, 3.97),
    ([4, 1, 3, 2], 0, 1.0),       # order does not matter
    ([4, 1, 3, 2], 100, 4.0),
    ([10, 20, 30, 40, 50], 50, 30.0),
    ([10, 20, 30, 40, 50], 99, 49.6),  # rank 3.96: 40 + 0.96 * 10
    ([7], 99, 7.0),
])
def test_percentile_interpolates_between_closest_ranks(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_one_requests_ttft_itl_tpot_e2e():
    r = request(sent=1.0, chunks=[1.1, 1.15, 1.35], done=1.4)
    assert r.ok
    assert r.ttft_ms == pytest.approx(100)
    assert r.itls_ms == pytest.approx([50, 200])
    assert r.e2e_ms == pytest.approx(400)
    assert r.tpot_ms == pytest.approx((400 - 100) / 2)
    assert request(0, [0.2], 0.3).tpot_ms is None and request(0, [0.2], 0.3).itls_ms == []


def test_goodput_counts_requests_meeting_both_targets():
    results = [
        request(0.0, [0.1, 0.2, 0.3], 0.3),          # TTFT 100, gaps 100, 100: meets
        request(0.0, [0.6, 0.7], 0.7),               # TTFT 600 > 500: misses
        request(0.5, [0.6, 0.7, 1.2], 1.2),          # a 500 ms stall > 300: misses
        request(1.0, [], None, error="HTTP 503"),    # failed: counts as missing
        request(1.0, [1.2], 2.0),                    # TTFT 200, one token, no gaps: meets
    ]
    assert [meets_slo(r, 500, 300) for r in results] == [True, False, False, False, True]
    summary = summarize(results, slo_ttft_ms=500, slo_itl_ms=300)
    assert summary["goodput"] == pytest.approx(2 / 5)
    assert summary["duration_s"] == pytest.approx(2.0)        # first send 0.0, last completion 2.0
    assert summary["goodput_requests_per_s"] == pytest.approx(2 / 2.0)
    assert summary["requests_ok"] == 4 and summary["requests_failed"] == 1
    assert summary["errors"] == {"HTTP 503": 1}
    assert summary["output_tokens"] == 3 + 2 + 3 + 1
    assert summary["output_tokens_per_s"] == pytest.approx(9 / 2.0)
    assert summary["requests_per_s"] == pytest.approx(4 / 2.0)
    # TTFTs of the ok requests: 100, 600, 100, 200 -> sorted 100, 100, 200, 600
    assert summary["ttft_ms"]["p50"] == pytest.approx(150)
    assert summary["ttft_ms"]["p99"] == pytest.approx(200 + 0.97 * 400)
    assert summary["ttft_ms"]["mean"] == pytest.approx(250)
    # ITL pools every gap: 100, 100, 100, 100, 500 -> P50 100, P95 rank 3.8: 100 + 0.8 * 400
    assert summary["itl_ms"]["p50"] == pytest.approx(100)
    assert summary["itl_ms"]["p95"] == pytest.approx(420)
    # TPOT per request with >= 2 tokens: (300-100)/2, (700-600)/1, (700-100)/2 -> 100, 100, 300
    assert summary["tpot_ms"]["p50"] == pytest.approx(100)
    assert summary["e2e_ms"]["p50"] == pytest.approx(700)     # 300, 700, 700, 1000


def test_a_run_with_no_successes_reports_nulls():
    summary = summarize([request(0, [], None, error="refused")], 100, 100)
    assert summary["ttft_ms"] == {"p50": None, "p95": None, "p99": None, "mean": None}
    assert summary["goodput"] == 0 and summary["requests_ok"] == 0
    assert "refused" in format_summary(summary)


def test_timeline_bins_tokens_by_arrival():
    timeline = throughput_timeline([request(0, [0.1, 0.2, 0.3, 1.6], 1.6), request(0, [1.7], 1.7)], 2.0)
    assert len(timeline["t_s"]) == 8  # 2 s in bins of at least 0.25 s
    assert timeline["output_tokens_per_s"][0] == pytest.approx(2 / 0.25)      # 0.1 and 0.2
    assert timeline["output_tokens_per_s"][1] == pytest.approx(1 / 0.25)      # 0.3
    assert timeline["output_tokens_per_s"][6] == pytest.approx(2 / 0.25)      # 1.6, 1.7
    assert sum(timeline["output_tokens_per_s"]) * 0.25 == pytest.approx(5)


def test_format_summary_prints_the_percentile_table():
    text = format_summary(summarize([request(0.0, [0.1, 0.2, 0.3], 0.3)], 500, 300))
    lines = text.splitlines()
    assert lines[0].split() == ["P50", "P95", "P99", "mean"]
    assert lines[1].split() == ["TTFT", "(ms)", "100.0", "100.0", "100.0", "100.0"]
    assert lines[2].split() == ["ITL", "(ms)", "100.0", "100.0", "100.0", "100.0"]
    assert "goodput: 100.0%" in text


def test_comparison_table_puts_runs_side_by_side():
    fast = summarize([request(0.0, [0.1, 0.2, 0.3], 0.3)], 500, 300)
    slow = summarize([request(0.0, [0.4, 0.6], 0.6), request(0.0, [], None, error="x")], 500, 300)
    lines = comparison_table([("contiguous.yaml", fast), ("balanced.yaml", slow)]).splitlines()
    assert lines[0].split() == ["contiguous.yaml", "balanced.yaml"]
    rows = {line[:18].strip(): line[18:].split() for line in lines[1:]}
    assert rows["requests failed"] == ["0", "1"]
    assert rows["output tokens/s"] == ["10.0", "3.3"]
    assert rows["TTFT P50 (ms)"] == ["100.0", "400.0"]
    assert rows["ITL P99 (ms)"] == ["100.0", "200.0"]
    assert rows["goodput"] == ["100.0%", "50.0%"]
