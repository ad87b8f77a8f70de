"""The cluster YAML's ``autoscale:`` section (cluster/config.py): off when absent, the policy it
builds, and one clear error per bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from raymoe.cluster.config import ConfigError, load_cluster_config, parse_cluster_config
from raymoe.moe.autoscale_policy import AutoscalePolicy

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "examples" / "cpu-autoscale.yaml"
BASE = {"model": "/models/m", "routers": 2, "expert_workers": 2}
GOOD = {"min_workers": 1, "max_workers": 4, "target_rows_per_worker": 8}
ROUTERS = {"min_routers": 1, "max_routers": 4, "target_requests_per_router": 8}


def parse(**autoscale):
    return parse_cluster_config(dict(BASE, autoscale=dict(GOOD, **autoscale)))


def test_absent_is_off():
    assert parse_cluster_config(BASE).autoscale is None


def test_the_example_builds_its_policy():
    config = load_cluster_config(EXAMPLE)
    assert config.autoscale.policy() == AutoscalePolicy(min_workers=1, max_workers=3, target_rows_per_worker=8.0,
                                                        band=0.25, cooldown_s=30.0, window_s=10.0, interval_s=2.0)


def test_router_limits_equal_to_routers_are_accepted():
    config = parse(min_routers=2, max_routers=2)
    assert config.autoscale.max_routers == 2 and not config.autoscale.policy().routers_on


def test_a_router_target_turns_router_autoscaling_on():
    policy = parse(**ROUTERS, target_queue_s=0.5).autoscale.policy()
    assert policy.routers_on and (policy.min_routers, policy.max_routers) == (1, 4)
    assert (policy.target_requests_per_router, policy.target_queue_s) == (8.0, 0.5)
    assert not parse().autoscale.policy().routers_on  # workers only, as before


@pytest.mark.parametrize("fields, message", [
    (dict(min_routers=1), "autoscale.min_routers: router autoscaling needs autoscale.target_requests_per_router "
                          "(running + waiting requests per router); set it, or set min_routers to routers (2) or "
                          "leave it out; got 1"),
    (dict(max_routers=4), "autoscale.max_routers: router autoscaling needs autoscale.target_requests_per_router"),
    (dict(target_requests_per_router=8), "autoscale.min_routers: required with autoscale.target_requests_per_router"),
    (dict(target_requests_per_router=8, min_routers=1), "autoscale.max_routers: required with "
                                                        "autoscale.target_requests_per_router"),
    (dict(ROUTERS, min_routers=3, max_routers=2), "autoscale.max_routers: expected >= autoscale.min_routers (3); "
                                                  "got 2"),
    (dict(ROUTERS, min_routers=3), "routers: the deployment starts with 2 routers, outside autoscale's [3, 4]"),
    (dict(ROUTERS, target_requests_per_router=0), "autoscale.target_requests_per_router: expected a number > 0 or null; "
                                                  "got 0"),
    (dict(ROUTERS, target_requests_per_router="lots"), "autoscale.target_requests_per_router: expected a number > 0 or null; "
                                                       "got 'lots'"),
    (dict(ROUTERS, target_queue_s=-1), "autoscale.target_queue_s: expected a number > 0 or null; got -1"),
    (dict(target_queue_s=0.5), "autoscale.target_queue_s: needs autoscale.target_requests_per_router"),
    (dict(ROUTERS, min_routers=0), "autoscale.min_routers: expected an integer >= 1 or null; got 0"),
    (dict(min_workers=3, max_workers=2), "autoscale.max_workers: expected >= autoscale.min_workers (3); got 2"),
    (dict(min_workers=3), "expert_workers: the deployment starts with 2 workers, outside autoscale's [3, 4]"),
    (dict(max_workers=1), "expert_workers: the deployment starts with 2 workers, outside autoscale's [1, 1]"),
    (dict(min_workers=0), "autoscale.min_workers: expected an integer >= 1; got 0"),
    (dict(target_rows_per_worker=0), "autoscale.target_rows_per_worker: expected a number > 0; got 0"),
    (dict(band=1), "autoscale.band: expected a number >= 0 and < 1; got 1"),
    (dict(band=-0.1), "autoscale.band: expected a number >= 0 and < 1; got -0.1"),
    (dict(cooldown_s=-5), "autoscale.cooldown_s: expected a number >= 0; got -5"),
    (dict(window_s=0), "autoscale.window_s: expected a number > 0; got 0"),
    (dict(interval_s="often"), "autoscale.interval_s: expected a number > 0; got 'often'"),
    (dict(routers=3), "autoscale.routers: unknown field; allowed fields: min_workers, max_workers, "
                      "target_rows_per_worker"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as error:
        parse(**fields)
    assert message in str(error.value), str(error.value)


def test_a_missing_target_and_a_section_that_is_not_a_mapping():
    with pytest.raises(ConfigError, match="autoscale.target_rows_per_worker: required field is missing"):
        parse_cluster_config(dict(BASE, autoscale={"min_workers": 1, "max_workers": 2}))
    with pytest.raises(ConfigError, match="autoscale: expected a mapping or null; got 'on'"):
        parse_cluster_config(dict(BASE, autoscale="on"))
