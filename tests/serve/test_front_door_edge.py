"""The edge of a real `raymoe serve` over loopback (actors/front_door.py): API keys through the
official openai client, JSON-only bodies, API docs and CORS off by default, body deadlines,
and a client that leaves mid-body costing one log line."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from raymoe.actors.front_door import ApiKeyError, api_key_digests, key_digest
from server_process import served

KEY = "sk-raymoe-config-key"
ENV_KEY = "sk-raymoe-env-key"
FILE_KEY = "sk-raymoe-file-key"
ADMIN = "edge-admin-token"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("edge")
    (folder / "keys.txt").write_text(f"# one key a line\n{FILE_KEY}\n")
    settings = (f"routers: 1\nexpert_workers: 1\nserve:\n  served_model_name: tiny\n  api_keys: [{KEY}]\n"
                f"  api_key_file: {folder / 'keys.txt'}\n  cors_allow_origins: ['{ORIGIN}']\n")
    yield from served(folder, tiny_mixtral_dir, settings, env={"RAYMOE_API_KEY": ENV_KEY, "RAYMOE_ADMIN_TOKEN": ADMIN})


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


COMPLETION = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).encode()


def test_the_openai_client_needs_a_key_and_each_source_of_keys_works(server):
    anonymous = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        anonymous.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "authentication_error" and refused.value.body["code"] == "invalid_api_key"
    texts = set()
    for key in (KEY, ENV_KEY, FILE_KEY):  # the YAML's list, RAYMOE_API_KEY, the key file
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        texts.add(client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0).choices[0].text)
        assert [m.id for m in client.models.list()] == ["tiny"]
    assert len(texts) == 1


def test_no_key_is_a_401_on_every_inference_route_and_health_and_metrics_stay_open(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        status, headers, body = request(server, "POST", path, COMPLETION, {"Content-Type": "application/json"})
        assert status == 401, (path, body)
        assert json.loads(body)["error"]["message"].startswith("missing API key")
        assert headers["www-authenticate"] == "Bearer"
    assert request(server, "GET", "/v1/models")[0] == 401
    assert request(server, "GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"})[0] == 401
    assert request(server, "GET", "/health")[0] == 200
    assert request(server, "GET", "/metrics")[0] == 200  # serve.metrics_need_key is off
    # /admin/* keeps its own token: the API key does not open it, the admin token does.
    assert request(server, "GET", "/admin/placement", headers={"Authorization": f"Bearer {KEY}"})[0] == 401
    assert request(server, "GET", "/admin/placement", headers={"Authorization": f"Bearer {ADMIN}"})[0] == 200


def test_keys_never_reach_the_log(server):
    log = server.tail(10**7)
    assert KEY not in log and ENV_KEY not in log and FILE_KEY not in log


def test_a_body_that_is_not_json_is_a_415(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**auth, **({"Content-Type": content_type} if content_type else {})}
        status, _, body = request(server, "POST", "/v1/completions", COMPLETION, headers)
        assert status == 415, (content_type, body)
        assert "Content-Type: application/json" in json.loads(body)["error"]["message"]
    status, _, _ = request(server, "POST", "/v1/completions", COMPLETION,
                           {**auth, "Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_api_docs_are_off_and_cors_is_an_allow_list(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert request(server, "GET", path, headers=auth)[0] == 404
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    status, headers, _ = request(server, "OPTIONS", "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and "access-control-allow-origin" not in headers
    status, headers, _ = request(server, "OPTIONS", "/v1/completions", headers={**preflight, "Origin": ORIGIN})
    assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = request(server, "POST", "/v1/completions", COMPLETION,
                                 {**auth, "Content-Type": "application/json", "Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = request(server, "POST", "/v1/completions", COMPLETION,
                                 {**auth, "Content-Type": "application/json", "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def send_partial(port: int, declared: int, sent: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {declared}\r\n\r\n").encode()
    connection.sendall(head + sent)
    return connection


def test_a_content_length_that_lies_is_answered_408_within_the_body_deadline(server):
    started = time.monotonic()
    connection = send_partial(server.port, 1000, b'{"prompt": [5, 6],')
    answer = b""
    try:
        while chunk := connection.recv(4096):  # the server closes the connection after its 408
            answer += chunk
    finally:
        connection.close()
    waited = time.monotonic() - started
    status_line, _, rest = answer.partition(b"\r\n")
    print(f"lying Content-Length: answered {status_line!r} after {waited:.2f} s")
    assert status_line.split()[1] == b"408", answer
    assert b"serve.body_min_bytes_per_s" in rest
    assert waited < 15  # 5 s of grace, then 20 bytes at >= 1 KiB/s; margin for 2 shared cores


def test_a_client_that_leaves_mid_body_costs_one_log_line_and_no_traceback(server):
    before = len(server.tail(10**7))
    for _ in range(20):
        send_partial(server.port, 1000, b'{"prompt": [5,').close()
    deadline = time.monotonic() + 20
    lines: list[str] = []
    while time.monotonic() < deadline and len(lines) < 20:  # bounded
        time.sleep(0.2)
        lines = [line for line in server.tail(10**7)[before:].splitlines() if "POST /v1/completions 499" in line]
    added = server.tail(10**7)[before:]
    assert len(lines) == 20, added[-3000:]  # one access line (status 499) each
    assert "Traceback" not in added and "ClientDisconnect" not in added and "never retrieved" not in added, added[-3000:]
    assert request(server, "GET", "/health")[0] == 200


def test_key_sources_and_their_errors(tmp_path):
    assert api_key_digests(environ={}) == ()
    file = tmp_path / "keys"
    file.write_text("# comment\n\nk1\nk2\n")
    assert api_key_digests(["k0"], str(file), environ={"RAYMOE_API_KEY": "k3"}) == tuple(
        key_digest(k) for k in ("k0", "k1", "k2", "k3"))
    with pytest.raises(ApiKeyError, match="cannot read"):
        api_key_digests((), str(tmp_path / "missing"), environ={})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        api_key_digests((), str(tmp_path / "empty"), environ={})
    with pytest.raises(ApiKeyError, match="whitespace"):
        api_key_digests(["two words"], None, environ={})
