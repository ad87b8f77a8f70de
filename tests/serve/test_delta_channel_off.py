"""``serve.delta_channel: false``: the ingress reaches its routers through Ray again (a ``submit``
call per request, a ``subscribe`` stream per router) and serves the same tokens as the in-process
engine, streamed and not, with a refusal still a 400. The default (the delta channel) is what
every other serve test runs; tests/serve/test_router_failure.py checks the channel is the one in use."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from server_process import served

TOKEN = "delta-channel-off-token"
PROMPTS = [[11 + i, 23 + i, 35 + i] for i in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("delta-channel-off"), tiny_mixtral_dir,
                      "routers: 2\nexpert_workers: 1\nengine:\n  kv_cache_bytes: 160000\n"
                      "serve:\n  delta_channel: false\n",
                      env={"RAYMOE_ADMIN_TOKEN": TOKEN})


def test_ray_path_serves_the_reference_tokens_streamed_and_not(server, tiny_mixtral_dir):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    expected = [o.output_token_ids for o in reference.generate(PROMPTS, params)]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    whole = [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
             for p in PROMPTS]
    assert [c.choices[0].model_extra["token_ids"] for c in whole] == expected
    for prompt, want in zip(PROMPTS, whole):
        text = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert text == want.choices[0].text
    request = urllib.request.Request(f"{server.url}/admin/placement", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        routers = json.loads(response.read())["routers"]
    assert [r["delta_channels"] for r in routers] == [0, 0]  # nobody connected: Ray carried it all


def test_a_request_whose_kv_can_never_fit_is_still_refused_by_the_router_as_a_400(server):
    # Within the context (the ingress lets it through) but beyond the fixture's small KV cache:
    # the router refuses it, here as a ValueError of its submit call.
    for stream in (False, True):
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 240, "stream": stream}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400
        assert "KV cache" in json.loads(refused.value.read())["error"]["message"]
