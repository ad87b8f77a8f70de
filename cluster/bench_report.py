"""Statistics, tables, JSON and plots of a `raymoe bench` run.

Definitions (all times from the client's side, in milliseconds unless named ``_s``):

- TTFT: from sending a request to the first streamed chunk that carries a token.
- ITL: every gap between two consecutive streamed chunks that carry tokens, pooled over all
  requests. raymoe streams one chunk per engine step, so a chunk carries one token.
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; requests with one token have none.
- E2E: from sending a request to its last byte.
- Percentiles interpolate linearly between the closest ranks (numpy's default).
- Goodput: the share of all requests (failed ones count as missing) whose TTFT is within
  ``slo_ttft_ms`` and whose own P99 ITL is within ``slo_itl_ms``: the P99 rather than the
  mean, so that a request with a long stall misses even when its average pace is fine
  (with fewer than 100 gaps, its P99 is close to its worst gap).
  ``goodput_requests_per_s`` is the number of such requests per second of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds since the run began."""

    prompt_tokens: int
    max_tokens: int
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    output_tokens: int = 0
    done_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and self.output_tokens > 0

    @property
    def ttft_ms(self) -> float:
        return (self.chunk_times_s[0] - self.sent_s) * 1e3

    @property
    def e2e_ms(self) -> float:
        return (self.done_s - self.sent_s) * 1e3

    @property
    def itls_ms(self) -> list[float]:
        times = self.chunk_times_s
        return [(b - a) * 1e3 for a, b in zip(times, times[1:])]

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """``{p50, p95, p99, mean}``; None (JSON null) when there are no values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    stats: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    stats["mean"] = sum(values) / len(values)
    return stats


def meets_slo(result: RequestResult, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
    if not result.ok:
        return False
    itls = result.itls_ms
    return result.ttft_ms <= slo_ttft_ms and (not itls or percentile(itls, 99) <= slo_itl_ms)


def throughput_timeline(results: Sequence[RequestResult], duration_s: float,
                        max_bins: int = 40, min_width_s: float = 0.25) -> dict[str, list[float]]:
    """Output tokens per second in equal time bins over the run (chunks counted at arrival):
    ``max_bins`` bins, fewer when that would make them narrower than ``min_width_s``."""
    num_bins = max(1, min(max_bins, int(duration_s / min_width_s)))
    width = max(duration_s, 1e-9) / num_bins
    counts = [0] * num_bins
    for result in results:
        for arrived in result.chunk_times_s:
            counts[min(int(arrived / width), num_bins - 1)] += 1
    return {"t_s": [(i + 0.5) * width for i in range(num_bins)], "output_tokens_per_s": [c / width for c in counts]}


def summarize(results: Sequence[RequestResult], slo_ttft_ms: float, slo_itl_ms: float,
              num_not_sent: int = 0) -> dict[str, Any]:
    """The JSON summary of one run. Duration: first send to last completion."""
    ok = [r for r in results if r.ok]
    ends = [r.done_s for r in results if r.done_s is not None] or [r.sent_s for r in results] or [0.0]
    start = min((r.sent_s for r in results), default=0.0)
    duration_s = max(max(ends) - start, 1e-9)
    good = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in results)
    output_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "no tokens")[:200]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "requests_not_sent": num_not_sent,
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens_per_s": output_tokens / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "ttft_ms": distribution([r.ttft_ms for r in ok]),
        "itl_ms": distribution([gap for r in ok for gap in r.itls_ms]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": distribution([r.e2e_ms for r in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "itl_p99_ms": slo_itl_ms},
        "goodput": good / len(results) if results else 0.0,
        "goodput_requests_per_s": good / duration_s,
        "errors": errors,
        "timeline": throughput_timeline(ok, duration_s),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable report: a percentile table, throughput and goodput."""
    lines = [f"{'':12}{'P50':>10}{'P95':>10}{'P99':>10}{'mean':>10}"]
    for key, name in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("tpot_ms", "TPOT (ms)"),
                      ("e2e_ms", "E2E (ms)")):
        stats = summary[key]
        lines.append(f"{name:12}" + "".join(f"{_ms(stats[k]):>10}" for k in ("p50", "p95", "p99", "mean")))
    lines.append(f"requests: {summary['requests_ok']} ok, {summary['requests_failed']} failed, "
                 f"{summary['requests_not_sent']} not sent, in {summary['duration_s']:.2f} s")
    lines.append(f"output tokens/s: {summary['output_tokens_per_s']:.1f}   "
                 f"requests/s: {summary['requests_per_s']:.2f}")
    slo = summary["slo"]
    lines.append(f"goodput: {100 * summary['goodput']:.1f}% of requests meet TTFT <= {slo['ttft_ms']:g} ms "
                 f"and ITL P99 <= {slo['itl_p99_ms']:g} ms ({summary['goodput_requests_per_s']:.2f} req/s)")
    for message, count in summary["errors"].items():
        lines.append(f"  {count} x {message}")
    return "\n".join(lines)


COMPARE_ROWS = (
    ("requests ok", lambda s: f"{s['requests_ok']}"),
    ("requests failed", lambda s: f"{s['requests_failed']}"),
    ("output tokens/s", lambda s: f"{s['output_tokens_per_s']:.1f}"),
    ("requests/s", lambda s: f"{s['requests_per_s']:.2f}"),
    ("TTFT P50 (ms)", lambda s: _ms(s["ttft_ms"]["p50"])),
    ("TTFT P99 (ms)", lambda s: _ms(s["ttft_ms"]["p99"])),
    ("ITL P50 (ms)", lambda s: _ms(s["itl_ms"]["p50"])),
    ("ITL P99 (ms)", lambda s: _ms(s["itl_ms"]["p99"])),
    ("TPOT P50 (ms)", lambda s: _ms(s["tpot_ms"]["p50"])),
    ("E2E P99 (ms)", lambda s: _ms(s["e2e_ms"]["p99"])),
    ("goodput", lambda s: f"{100 * s['goodput']:.1f}%"),
)


def comparison_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Runs side by side: one column per (label, summary), one row per figure."""
    width = max([22] + [len(label) + 2 for label, _ in runs])
    lines = [f"{'':18}" + "".join(f"{label:>{width}}" for label, _ in runs)]
    for name, cell in COMPARE_ROWS:
        lines.append(f"{name:18}" + "".join(f"{cell(summary):>{width}}" for _, summary in runs))
    return "\n".join(lines)


def write_plot(runs: Sequence[tuple[str, Sequence[RequestResult], dict[str, Any]]], path: str) -> None:
    """Three panels, one line per run: TTFT CDF, ITL CDF, output tokens/s over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axes, itl_axes, time_axes) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, results, summary in runs:
        ok = [r for r in results if r.ok]
        for axes, values in ((ttft_axes, [r.ttft_ms for r in ok]), (itl_axes, [g for r in ok for g in r.itls_ms])):
            ordered = sorted(values)
            axes.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], drawstyle="steps-post",
                      label=label)
        timeline = summary["timeline"]
        time_axes.plot(timeline["t_s"], timeline["output_tokens_per_s"], label=label)
    for axes, title, xlabel in ((ttft_axes, "TTFT CDF", "TTFT (ms)"), (itl_axes, "ITL CDF", "ITL (ms)"),
                                (time_axes, "output throughput", "time since start (s)")):
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    ttft_axes.set_ylabel("share of requests")
    itl_axes.set_ylabel("share of token gaps")
    time_axes.set_ylabel("output tokens/s")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
