"""serve.ingress: which HTTP path `raymoe serve` sets up, and what it tells Ray Serve.

End to end, every test under tests/serve runs through the default (`auto`, a local Ray:
direct ingress); here the choice itself, for each mode and both kinds of Ray.
"""

from __future__ import annotations

import os

import pytest

from raymoe.cluster.config import IngressMode, parse_cluster_config
from raymoe.cluster.serve_cli import _direct_ingress

DIRECT_VARS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
               "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")


ALL_VARS = (*DIRECT_VARS, "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
            "RAY_SERVE_DIRECT_INGRESS_PORT_RETRY_COUNT")


@pytest.fixture
def clean_env(monkeypatch):
    """Absent for the test, and absent again afterwards: what _direct_ingress writes must not
    leak into later tests' server processes (they inherit this process's environment)."""
    for name in ALL_VARS:
        monkeypatch.setenv(name, "x")  # records the original state, restored at teardown
        monkeypatch.delenv(name)
    yield


@pytest.mark.parametrize("mode, started_ray, direct", [
    ("auto", True, True), ("auto", False, False),
    ("direct", True, True), ("direct", False, True),
    ("proxy", True, False), ("proxy", False, False),
])
def test_mode_decides_the_path(clean_env, mode, started_ray, direct):
    config = parse_cluster_config({"model": "/m", "serve": {"ingress": mode, "port": 8321}})
    assert config.serve.ingress is IngressMode(mode)
    assert _direct_ingress(config, started_ray) is direct
    if direct and started_ray:  # the replica, not the proxy, binds serve.port; nothing to drain from
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8321"
        assert os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8322"
        assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    elif started_ray:  # a local proxy: an inherited direct-ingress setting is switched off
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
        assert not any(name in os.environ for name in DIRECT_VARS[1:])
    else:  # an existing cluster's Serve reads its own environment: nothing is set here
        assert not any(name in os.environ for name in DIRECT_VARS)


def test_unknown_mode_is_refused_naming_the_field():
    with pytest.raises(Exception, match="serve.ingress"):
        parse_cluster_config({"model": "/m", "serve": {"ingress": "haproxy"}})
