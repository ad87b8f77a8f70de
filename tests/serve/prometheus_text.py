"""Reading a /metrics page in tests: scrape, parse, check with promtool where installed."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Family name (as the parser names it: a counter without its _total) -> type. vLLM's names
# under raymoe:, then raymoe's own.
FAMILIES = {
    "raymoe:num_requests_running": "gauge",
    "raymoe:num_requests_waiting": "gauge",
    "raymoe:kv_cache_usage_perc": "gauge",
    "raymoe:num_preemptions": "counter",
    "raymoe:request_success": "counter",
    "raymoe:time_to_first_token_seconds": "histogram",
    "raymoe:inter_token_latency_seconds": "histogram",
    "raymoe:time_per_output_token_seconds": "histogram",
    "raymoe:e2e_request_latency_seconds": "histogram",
    "raymoe:request_queue_time_seconds": "histogram",
    "raymoe:prompt_tokens": "counter",
    "raymoe:generation_tokens": "counter",
    "raymoe:prefix_cache_queries": "counter",
    "raymoe:prefix_cache_hits": "counter",
    "raymoe:kv_cache_capacity_tokens": "gauge",
    "raymoe:prefix_cache_hit_rate": "gauge",
    "raymoe:http_requests": "counter",
    "raymoe:router_generated_tokens": "counter",
    "raymoe:worker_routed_tokens": "counter",
    "raymoe:dropped_tokens": "counter",
    "raymoe:balancedness": "gauge",
    "raymoe:window_balancedness": "gauge",
    "raymoe:rebalances": "counter",
    "raymoe:migration_seconds": "counter",
    "raymoe:migration_bytes": "counter",
}

# The one promtool lint raymoe accepts: colons are what vLLM's names (vllm:...) use too.
COLON_LINT = "metric names should not contain ':'"


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        return response.read().decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(parsed: dict, sample: str, **labels: str) -> float:
    """Sample ``sample`` (e.g. ``raymoe:request_success_total``) summed over the series whose
    labels include ``labels``; 0 when none has been exported yet."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    if family not in parsed:
        return 0.0
    return sum(s.value for s in parsed[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def promtool_problems(text: str) -> list[str] | None:
    """``promtool check metrics`` on ``text``: its problems other than COLON_LINT (None when
    promtool is not on PATH). A parse error is a problem too."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    problems = [line for line in lines if not line.endswith(COLON_LINT)]
    if done.returncode not in (0, 3):  # 3: lint problems only; anything else failed to check
        problems.append(f"promtool exited {done.returncode}")
    return problems
