"""The edge of a real `raymoe serve` over loopback (actors/front_door.py): API keys through the
official openai client, JSON-only bodies, API docs and CORS off by default, body deadlines,
and a client that leaves mid-body costing one log line."""

from __future__ import annotations

import http.client
import json
import select
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
                f"  api_key_file: {folder / 'keys.txt'}\n  cors_allow_origins: ['{ORIGIN}']\n"
                f"  body_timeout_s: 15\n  body_min_bytes_per_s: 0\n  max_open_requests: 2100\n"
                f"  max_requests_per_client: 256\n"
                f"  keep_alive_timeout_s: 2\n  header_timeout_s: 3\n")
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


def send_partial(port: int, declared: int, sent: bytes, source: str = "127.0.0.1") -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {declared}\r\n\r\n").encode()
    connection.sendall(head + sent)
    return connection


def test_a_content_length_that_lies_is_answered_408_at_the_body_deadline(server):
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
    assert b"serve.body_timeout_s is 15 s" in rest
    assert 14.5 < waited < 25  # serve.body_timeout_s; margin for 2 shared cores


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


def status_of(connection: socket.socket, timeout: float = 10) -> int | None:
    """The status of the answer waiting on ``connection``, or None if none came in ``timeout``."""
    connection.settimeout(timeout)
    try:
        head = connection.recv(64)
    except socket.timeout:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else None


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_two_thousand_half_sent_bodies_leave_health_and_completions_answering(server):
    """2,048 half-sent bodies from 8 addresses (256 each: every client's cap), then 10 more from
    one of them (429) and 80 from new addresses (past serve.max_open_requests: 503), while
    /health and a completion from another address keep answering within 1 s."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    held: list[socket.socket] = []
    first = time.monotonic()
    try:
        for index in range(8 * 256):
            held.append(send_partial(server.port, 1000, b'{"prompt": [5,', source=f"127.0.0.{2 + index % 8}"))
        over_client = [send_partial(server.port, 1000, b"{", source="127.0.0.2") for _ in range(10)]
        assert [status_of(c) for c in over_client] == [429] * 10
        for connection in over_client:
            connection.close()
        latencies, completions = [], []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # bounded: 3 s (the bodies' deadline is 15 s)
            latencies.append(timed(lambda: request(server, "GET", "/health", timeout=5)))
            latencies.append(timed(lambda: request(server, "GET", "/metrics", timeout=5)))
            completions.append(timed(lambda: client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                                                         temperature=0)))
        print(f"{len(held)} half-sent bodies held: /health and /metrics max {1e3 * max(latencies):.0f} ms over "
              f"{len(latencies)} calls; completions max {1e3 * max(completions):.0f} ms over {len(completions)}")
        assert max(latencies) < 1.0 and max(completions) < 1.0
        # Past serve.max_open_requests (2100): 503 with Retry-After, and the probes still answer.
        over_all = [send_partial(server.port, 1000, b"{", source=f"127.0.1.{1 + i}") for i in range(80)]
        time.sleep(1)
        statuses = [status_of(c, timeout=0.05) for c in over_all]
        held += [c for c, status in zip(over_all, statuses) if status is None]
        assert statuses.count(503) >= 80 - (2100 - 2048), statuses
        assert set(statuses) <= {503, None}
        assert timed(lambda: request(server, "GET", "/health", timeout=5)) < 1.0
        status, headers, _ = request(server, "POST", "/v1/completions", COMPLETION,
                                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert status == 503 and headers["retry-after"] == "1"
        assert time.monotonic() - first < 15, "the held bodies reached their deadline: the test proved less"
    finally:
        for connection in held:
            connection.close()


def test_an_idle_keep_alive_connection_is_closed(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        time.sleep(3.5)  # serve.keep_alive_timeout_s is 2 in this server
        connection.sock.settimeout(5)
        assert connection.sock.recv(1) == b"", "the idle connection was still open"
    finally:
        connection.close()


class _Replay:
    """An ASGI receive that hands out body chunks with a pause before each (a slow client)."""

    def __init__(self, chunks: list[tuple[float, bytes]]):
        self.chunks = list(chunks)

    async def __call__(self) -> dict:
        import asyncio

        if not self.chunks:
            await asyncio.sleep(3600)
        pause, body = self.chunks.pop(0)
        await asyncio.sleep(pause)
        return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}


def run_front_door(policy, chunks: list[tuple[float, bytes]]) -> tuple[int, bytes, float]:
    """One POST through :class:`FrontDoor` (over an app that reads the whole body, then 200s)."""
    import asyncio

    from raymoe.actors.front_door import FrontDoor

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        FrontDoor.configure(policy)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json")]}
        started = time.monotonic()
        await FrontDoor(app)(scope, _Replay(chunks), send)
        return time.monotonic() - started

    try:
        took = asyncio.run(main())
    finally:
        from raymoe.actors.front_door import FrontDoorPolicy

        FrontDoor.configure(FrontDoorPolicy())
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), took


def test_a_trickling_body_is_cut_at_the_minimum_rate_and_a_steady_one_is_not(monkeypatch):
    from raymoe.actors import front_door
    from raymoe.actors.front_door import FrontDoorPolicy

    monkeypatch.setattr(front_door, "BODY_GRACE_S", 0.5)
    policy = FrontDoorPolicy(body_timeout_s=30, body_min_bytes_per_s=100)
    # 10 bytes every 0.2 s is 50 bytes/s: cut once the grace and the bytes' credit run out.
    status, body, took = run_front_door(policy, [(0.2, b"x" * 10)] * 40)
    assert status == 408 and b"serve.body_min_bytes_per_s" in body
    assert 0.6 < took < 2.5, took
    # 40 bytes every 0.2 s is 200 bytes/s: it arrives whole.
    status, _, _ = run_front_door(policy, [(0.2, b"x" * 40)] * 10)
    assert status == 200
    # Past the total deadline, whatever the rate.
    status, body, took = run_front_door(FrontDoorPolicy(body_timeout_s=1, body_min_bytes_per_s=0),
                                        [(0.3, b"x" * 1000)] * 10)
    assert status == 408 and b"serve.body_timeout_s is 1 s" in body and took < 2


def test_slow_headers_are_cut_off_with_a_408(server):
    """One header byte a second (a slowloris): 408 and closed at serve.header_timeout_s (3 s here)."""
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    started = time.monotonic()
    answer = b""
    try:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for byte in b"X-Slow: " + b"a" * 30:  # bounded: 38 s at most
            # Wait up to a second for the server, and read what came before sending more: a byte
            # sent after its 408 and close draws a reset, which can discard the 408 unread.
            if select.select([connection], [], [], 1.0)[0]:
                try:
                    chunk = connection.recv(4096)
                except ConnectionResetError:
                    break
                answer += chunk
                if not chunk:
                    break
                continue
            if answer:
                break  # the answer came and nothing follows it
            try:
                connection.sendall(bytes([byte]))
            except OSError:  # closed by the server
                break
        waited = time.monotonic() - started
    finally:
        connection.close()
    print(f"slow headers: {answer[:40]!r} after {waited:.1f} s")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 2.5 < waited < 10
    # A client that sends its headers at once is untouched, on a kept-alive connection too.
    client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for _ in range(2):
            client.request("GET", "/health")
            assert client.getresponse().read()
            time.sleep(1)
    finally:
        client.close()
