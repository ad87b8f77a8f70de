"""Resizing the router pool while serving (issue 31 item 1, actors/router_resize.py): a router
added under load joins the group and serves, one removed finishes what it holds and leaves, and
every output equals the in-process engine's; bad sizes are refused and change nothing."""

from __future__ import annotations

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy
from test_resize import generate_while

CONFIG = dict(expert_workers=2, routers=1, comm={"backend": "sockets", "timeout_s": 3.0},
              balancer={"enabled": False}, engine={"max_num_seqs": 8})  # many steps: the resize lands mid-run


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(32, seed=37)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


@pytest.fixture(scope="module")
def deployment(ray_session, tiny_mixtral_dir):
    deployed = deploy(cluster_config(tiny_mixtral_dir, **CONFIG), name="router-resize")
    yield deployed
    deployed.shutdown()


def test_grow_then_shrink_the_routers_under_load_keeps_outputs(deployment, expected):
    batch, want = expected
    outputs, grown = generate_while(deployment, batch, lambda: deployment.resize_routers(2))
    assert [o.output_token_ids for o in outputs] == want  # none failed, outputs identical
    assert grown["resized"] is True and (grown["routers_before"], grown["routers"]) == (1, 2), grown
    assert len(deployment.routers) == 2
    status = deployment.status()
    assert status["num_routers"] == 2 and [r["router"] for r in status["routers"]] == ["router-0", "router-1"]
    assert ray.get(deployment.controller.serving_routers.remote()) == {"routers": 2, "serving": 2}
    # The new router is in the group and serves: half of a batch runs on it.
    before = deployment.telemetry()[1]["generated_tokens"]
    assert [o.output_token_ids for o in deployment.generate(batch[:8], GREEDY)] == want[:8]
    assert deployment.telemetry()[1]["generated_tokens"] > before

    outputs, shrunk = generate_while(deployment, batch, lambda: deployment.resize_routers(1))
    assert [o.output_token_ids for o in outputs] == want  # the leaving router finished its requests
    assert shrunk["resized"] is True and shrunk["routers"] == 1 and shrunk["drained"] is True, shrunk
    assert len(deployment.routers) == 1 and deployment.status()["num_routers"] == 1
    assert ray.get(deployment.controller.serving_routers.remote()) == {"routers": 1, "serving": 1}
    assert [o.output_token_ids for o in deployment.generate(batch[:8], GREEDY)] == want[:8]


@pytest.mark.parametrize("routers", [0, -1, "2", 1.5])
def test_a_bad_router_count_is_refused_and_changes_nothing(deployment, routers):
    report = ray.get(deployment.controller.resize_routers.remote(routers))
    assert report["refused"] is True and report["status"] == 400 and "routers must be an integer >= 1" in report["error"]
    assert deployment.status()["num_routers"] == len(deployment.routers)
