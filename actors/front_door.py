"""The HTTP endpoint's edge policy: who may call which route, what a body must be, how fast
it must arrive, and what a client that leaves costs.

:class:`FrontDoor` is a pure ASGI middleware in front of the ingress' routes
(actors/ingress.py), configured once per replica with a :class:`FrontDoorPolicy`:

- **API keys** (``serve.api_keys``, ``serve.api_key_file``, ``raymoe serve --api-key``,
  ``RAYMOE_API_KEY``): every route but ``/health`` needs ``Authorization: Bearer KEY``, and
  ``/metrics`` too when ``serve.metrics_need_key``. The replica holds SHA-256 digests only
  (keys never reach a log, a Ray object or a config dump) and compares them in constant
  time against every digest. ``/admin/*`` keeps its own token (``RAYMOE_ADMIN_TOKEN``).
- **JSON only**: a route that reads a JSON body answers 415 to any other content type, so
  no web page can post to the endpoint with a CORS "simple" request (``text/plain``).
  CORS is off unless ``serve.cors_allow_origins`` lists origins; ``/docs``, ``/redoc`` and
  ``/openapi.json`` answer 404 unless ``serve.enable_docs``.
- **Body deadline**: a body must arrive within ``serve.body_timeout_s`` in all, and after the
  first ``BODY_GRACE_S`` at ``serve.body_min_bytes_per_s`` or faster on average; otherwise
  408 (a Content-Length that lies, a client that trickles).
- **Admission before exhaustion**: at most ``serve.max_open_requests`` requests in the replica
  at once (503 beyond) and ``serve.max_requests_per_client`` from one client address (429
  beyond), both with ``Retry-After``; the deployment's own slot count (Serve's
  ``max_ongoing_requests``) lies above the first by :data:`PROBE_HEADROOM`, so ``/health``
  and ``/metrics``, which neither cap counts, still answer when every slot a client may take
  is busy (with half-sent bodies, say).
- **Quiet disconnects**: a client that leaves mid-body costs one log line (Serve's access
  line, status 499), no traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from starlette.requests import ClientDisconnect

from raymoe.engine.api.openai_protocol import RequestError

LOG = logging.getLogger("raymoe.ingress")
BODY_GRACE_S = 5.0  # the minimum rate applies after this long (a slow start is not an attack)
JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
DOCS_ROUTES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_ROUTES = frozenset({"/health"})
UNCOUNTED_ROUTES = frozenset({"/health", "/metrics"})  # probes: never refused for load
PROBE_HEADROOM = 64  # Serve slots beyond serve.max_open_requests, for the probes
RETRY_AFTER_S = 1
API_KEY_ENV = "RAYMOE_API_KEY"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Refusal = tuple[RequestError, Headers]  # the error (its status and OpenAI body) and extra headers


class ApiKeyError(ValueError):
    """An API key source that cannot be used (an unreadable file, an empty or blank key)."""


@dataclass(frozen=True)
class FrontDoorPolicy:
    key_digests: tuple[bytes, ...] = ()  # SHA-256 of each API key; empty: no key needed
    metrics_need_key: bool = False
    enable_docs: bool = False
    cors_allow_origins: tuple[str, ...] = ()
    body_timeout_s: float = 30.0
    body_min_bytes_per_s: float = 1024.0
    max_open_requests: int = 4096
    max_requests_per_client: int = 1024

    @property
    def needs_key(self) -> bool:
        return bool(self.key_digests)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def api_key_digests(keys: Iterable[str] = (), key_file: str | None = None,
                    environ: dict[str, str] | None = None) -> tuple[bytes, ...]:
    """The digests of every API key from the config's list, its key file (one key a line,
    ``#`` comments and blank lines skipped) and ``RAYMOE_API_KEY``; () when none is set."""
    environ = os.environ if environ is None else environ
    found: list[tuple[str, str]] = [("serve.api_keys / --api-key", key) for key in keys]
    if key_file:
        try:
            text = Path(key_file).expanduser().read_text()
        except OSError as error:
            raise ApiKeyError(f"serve.api_key_file: cannot read {key_file}: {error.strerror or error}") from None
        lines = [line.strip() for line in text.splitlines()]
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ApiKeyError(f"serve.api_key_file: {key_file} holds no key (one key a line)")
        found += [(f"serve.api_key_file {key_file}", key) for key in file_keys]
    if environ.get(API_KEY_ENV):
        found.append((API_KEY_ENV, environ[API_KEY_ENV]))
    for source, key in found:
        if not key.strip() or key != key.strip() or any(ch.isspace() for ch in key):
            raise ApiKeyError(f"{source}: an API key must be non-empty and hold no whitespace")
    return tuple(dict.fromkeys(key_digest(key) for _, key in found))


class BodyTimeout(Exception):
    def __init__(self, received: int, elapsed: float, reason: str):
        super().__init__(f"request body incomplete after {elapsed:.1f} s ({received} bytes): {reason}")


def _cors(allowed_origin: str | None) -> Headers:
    """The headers that grant ``allowed_origin`` the response (none without a grant)."""
    return [] if allowed_origin is None else [(b"access-control-allow-origin", allowed_origin.encode()),
                                              (b"vary", b"Origin")]


def _media_type(headers: dict[bytes, bytes]) -> str:
    return headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class FrontDoor:
    """ASGI middleware applying the replica's :class:`FrontDoorPolicy` (set with :meth:`configure`
    before the first request; the default policy needs no key and serves no docs)."""

    policy = FrontDoorPolicy()
    open_requests = 0  # counted requests in this replica now
    per_client: dict[str, int] = {}  # client address -> its counted requests now

    @classmethod
    def configure(cls, policy: FrontDoorPolicy) -> None:
        cls.policy = policy

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy
        path: str = scope.get("path", "")
        method: str = scope.get("method", "GET")
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        allowed_origin = origin if origin and origin in policy.cors_allow_origins else None
        if method == "OPTIONS" and b"access-control-request-method" in headers:  # a CORS preflight
            await self._preflight(send, allowed_origin)
            return
        counted = path not in UNCOUNTED_ROUTES
        address = (scope.get("client") or ("unknown",))[0]
        refusal = self._refusal(policy, path, method, headers) or (
            self._admission(policy, address) if counted else None)
        if refusal is not None:
            await self._answer(send, *refusal, allowed_origin)
            return
        if counted:
            FrontDoor.open_requests += 1
            FrontDoor.per_client[address] = FrontDoor.per_client.get(address, 0) + 1
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if allowed_origin is not None:
                    message = {**message, "headers": [*message.get("headers", []), *_cors(allowed_origin)]}
            await send(message)

        try:
            await self.app(scope, self._deadline_receive(receive, policy), sending)
        except BodyTimeout as error:
            LOG.info("%s %s from %s: %s", method, path, _client(scope), error)
            if not started:
                timeout = RequestError(f"{error}; send the whole body promptly", status=408, code="request_timeout")
                await self._answer(send, timeout, [(b"connection", b"close")], allowed_origin)
        except ClientDisconnect:  # Serve's access log has its one line (status 499): no traceback beside it
            LOG.debug("%s %s from %s: the client left before its body arrived", method, path, _client(scope))
        finally:
            if counted:
                FrontDoor.open_requests -= 1
                left = FrontDoor.per_client[address] - 1
                if left:
                    FrontDoor.per_client[address] = left
                else:
                    del FrontDoor.per_client[address]

    @classmethod
    def _admission(cls, policy: FrontDoorPolicy, address: str) -> Refusal | None:
        retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        if cls.per_client.get(address, 0) >= policy.max_requests_per_client:
            return RequestError(f"too many requests at once from {address} (serve.max_requests_per_client is "
                                f"{policy.max_requests_per_client}); retry shortly", status=429,
                                error_type="rate_limit_error", code="too_many_requests"), retry
        if cls.open_requests >= policy.max_open_requests:
            return RequestError(f"the server holds serve.max_open_requests ({policy.max_open_requests}) requests; "
                                f"retry shortly", status=503, error_type="server_error", code="overloaded"), retry
        return None

    @staticmethod
    def _refusal(policy: FrontDoorPolicy, path: str, method: str, headers: dict[bytes, bytes]) -> Refusal | None:
        if path in DOCS_ROUTES and not policy.enable_docs:
            return RequestError("Not Found (API docs are off; set serve.enable_docs: true)", status=404,
                                error_type="not_found", code="not_found"), []
        guarded = path not in OPEN_ROUTES and not path.startswith("/admin/") and (
            path != "/metrics" or policy.metrics_need_key)
        if guarded and policy.needs_key:
            given = headers.get(b"authorization", b"")
            scheme, _, key = given.partition(b" ")
            digest = hashlib.sha256(key.strip()).digest()
            matched = False
            for expected in policy.key_digests:  # every digest compared: the time says nothing
                matched |= hmac.compare_digest(digest, expected)
            if scheme.lower() != b"bearer" or not matched:
                message = ("missing API key: send Authorization: Bearer KEY (the openai client's api_key)"
                           if not given else "invalid API key")
                return RequestError(message, status=401, error_type="authentication_error",
                                    code="invalid_api_key"), [(b"www-authenticate", b"Bearer")]
        if method == "POST" and path in JSON_ROUTES:
            media_type = _media_type(headers)
            if not _is_json(media_type):
                shown = media_type or "none"
                return RequestError(f"the request body must be JSON: send Content-Type: application/json "
                                    f"(got {shown})", status=415, code="unsupported_media_type"), []
        return None

    @staticmethod
    def _deadline_receive(receive: Receive, policy: FrontDoorPolicy) -> Receive:
        """``receive`` with the body's deadline while the body is incomplete, plain after it."""
        start = time.monotonic()
        received = 0
        complete = False

        async def timed() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            now = time.monotonic()
            deadline = start + policy.body_timeout_s
            reason = f"serve.body_timeout_s is {policy.body_timeout_s:g} s"
            if policy.body_min_bytes_per_s > 0:
                rate_deadline = start + BODY_GRACE_S + received / policy.body_min_bytes_per_s
                if rate_deadline < deadline:
                    deadline = rate_deadline
                    reason = f"slower than serve.body_min_bytes_per_s ({policy.body_min_bytes_per_s:g} bytes/s)"
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - now))
            except asyncio.TimeoutError:
                raise BodyTimeout(received, time.monotonic() - start, reason) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            return message

        return timed

    @staticmethod
    async def _answer(send: Send, error: RequestError, extra: Headers, allowed_origin: str | None) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra,
                   *_cors(allowed_origin)]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _preflight(send: Send, allowed_origin: str | None) -> None:
        if allowed_origin is None:  # CORS off, or an origin not on the list: no grant
            headers = [(b"content-length", b"0")]
            status = 403
        else:
            headers = [*_cors(allowed_origin), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                       (b"access-control-allow-headers", b"authorization, content-type"),
                       (b"access-control-max-age", b"600"), (b"content-length", b"0")]
            status = 204
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"
