"""What stands between the network and the API: limits, origin and key checks, and one error shape for all.

    connection ─► GuardedH11 (uvicorn's h11 protocol): at most `max_connections` open (the next gets a 503 and
                  is closed); headers must arrive within `header_timeout_s`, or the connection is closed
    request ───► Guard (ASGI):  Host must name this server (DNS rebinding) ─► a cross-site Origin is refused
                  unless listed (--cors-origin; CORS preflights answered) ─► `Authorization: Bearer KEY` when the
                  server has a key (compared in constant time) ─► POST bodies: JSON content type only (no
                  form-encoded cross-site posts), at most `max_body_bytes`, read within `body_timeout_s`, a client
                  that hangs up mid-body is one log line ─► the app; every response counted by endpoint and status

Every refusal is an OpenAI-style JSON error ({"error": {"message", "type", "param", "code"}}). The defaults fit
a server on the loopback interface that any local program may call; `--api-key` is what makes a server bound
beyond it safe to expose.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specrt.serve.protocol import APIError

log = logging.getLogger("specrt.serve")

PUBLIC_PATHS = frozenset({"/", "/health", "/openapi.json"})  # readable without the API key
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "authorization, content-type"


@dataclass(frozen=True)
class Limits:
    """The server's protections (`specrt serve` flags of the same names)."""

    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # "*": any origin
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted ("*": any); () -> derived from the bind address


def allowed_hosts(bind: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Host names a server bound to `bind` answers to: loopback names for a loopback bind, the address itself for
    another, anything for a wildcard bind (0.0.0.0, ::) unless names are given; plus `extra`."""
    extra = tuple(e.strip().lower() for e in extra)
    if "*" in extra:
        return ("*",)
    if bind.lower() == "localhost":
        return (*LOOPBACK_NAMES, *extra)
    try:
        ip = ipaddress.ip_address(bind)
    except ValueError:  # a host name
        return (bind.lower(), *extra)
    if ip.is_unspecified:
        return tuple(extra) or ("*",)
    return (*(LOOPBACK_NAMES if ip.is_loopback else (str(ip),)), *extra)


def is_loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind.lower() == "localhost"


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:
    """The API's error shape (protocol.APIError's), as bytes to send."""
    return json.dumps(APIError(message, kind=kind, param=param, code=code).body()).encode()


def _host_name(host: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _BodyTimeout(Exception):
    pass


class _Disconnected(Exception):
    pass


class Guard:
    """ASGI middleware applying `limits` to every HTTP request before `app` sees it; `count(endpoint, status)` is
    called once per response, the endpoint being the path when it is one of `endpoints`, else "other" (so a
    client cannot grow the set of labels)."""

    def __init__(self, app: Callable, limits: Limits, count: Callable[[str, int], None],
                 endpoints: Iterable[str] = ()) -> None:
        self.app, self.limits, self.count, self.endpoints = app, limits, count, frozenset(endpoints)
        self.key = limits.api_key.encode() if limits.api_key else None
        self.hosts = set(limits.allowed_hosts)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status: list[int] = []

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if cors is not None:
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(cors)]}
            await send(message)

        cors = None
        try:
            refusal = self._refusal(scope, headers)
            origin = headers.get("origin")
            if refusal is None and origin is not None and not self._same_origin(scope, headers, origin):
                cors = origin  # allowed by --cors-origin (else refused above): answer with CORS headers
                if scope["method"] == "OPTIONS":
                    await _respond(counted, 204, b"")
                    return
            if refusal is not None:
                await _respond(counted, *refusal)
                return
            if scope["method"] == "POST":
                try:
                    body = await self._read_body(receive, headers)
                except _Disconnected:
                    log.warning("specrt: %s hung up while sending its request body to %s", _client(scope), path)
                    return
                except _BodyTimeout:
                    await _respond(counted, 408, error_body(
                        f"the request body did not arrive within {self.limits.body_timeout_s:g} s"), close=True)
                    return
                except _TooLarge as e:
                    await _respond(counted, 413, error_body(str(e), code="request_too_large"), close=True)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, counted)
        finally:
            if status:
                self.count(endpoint, status[0])

    def _refusal(self, scope: dict, headers: dict[str, str]) -> tuple[int, bytes] | None:
        """(status, body) when the request must not reach the app, else None."""
        if "*" not in self.hosts and _host_name(headers.get("host", "")) not in self.hosts:
            return 421, error_body(f"this server does not answer to the Host {headers.get('host', '')!r} "
                                   "(a DNS-rebinding page would send such a request; use --allowed-host to add names)",
                                   code="invalid_host")
        origin = headers.get("origin")
        if origin is not None and not self._same_origin(scope, headers, origin) \
                and "*" not in self.limits.cors_origins and origin not in self.limits.cors_origins:
            return 403, error_body(f"cross-origin requests from {origin!r} are refused (allow an origin with "
                                   "--cors-origin)", code="cross_origin")
        if scope["method"] == "OPTIONS":
            return None if origin is not None else (405, error_body("OPTIONS is only for CORS preflights"))
        if self.key is not None and scope["path"] not in PUBLIC_PATHS:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            # the header's own bytes (decoded as latin-1 above, so encoding back gives them) against the key's UTF-8:
            # a non-ASCII key matches as a client sends it, in UTF-8
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                return 401, error_body("missing or wrong API key (send `Authorization: Bearer KEY`)",
                                       code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return 415, error_body(f"the request body must be JSON (Content-Type: application/json), got "
                                       f"{kind or 'no content type'!r}", code="unsupported_media_type")
        return None

    @staticmethod
    def _same_origin(scope: dict, headers: dict[str, str], origin: str) -> bool:
        return origin.lower() == f"{scope.get('scheme', 'http')}://{headers.get('host', '')}".lower()

    async def _read_body(self, receive: Callable, headers: dict[str, str]) -> bytes:
        """The whole body, within the size limit and the time limit."""
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _TooLarge(f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                            "(--max-body-bytes)")
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise _BodyTimeout() from None
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge(f"the request body is over {limit} bytes, the most this server takes "
                                "(--max-body-bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


def _replay(body: bytes, receive: Callable) -> Callable:
    """A `receive` that gives the app the body already read, then passes on what the client does next (a
    disconnect, which is how a handler learns that its client went away)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", CORS_HEADERS.encode()),
            (b"access-control-expose-headers", b"x-specrt-request-id")]


async def _respond(send: Callable, status: int, body: bytes, *, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the body is never read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _client(scope: dict) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"


def guarded_protocol(limits: Limits, count: Callable[[str, int], None] | None = None) -> type:
    """uvicorn's h11 protocol with a connection cap and a header timeout (uvicorn has neither: a client sending
    headers one byte at a time, or nothing, held its connection for good); a request h11 cannot parse (a bad
    Content-Length, two Host headers) gets the API's JSON error, counted by `count` as endpoint "other", where uvicorn
    answers plain text that no metric saw."""

    class GuardedH11(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = error_body(f"malformed HTTP request: {msg}", code="malformed_request")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            if count is not None:
                count("other", 400)

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            if len(self.server_state.connections) >= limits.max_connections:
                body = error_body(f"this server holds its maximum of {limits.max_connections} connections; try "
                                  "again later", kind="server_error", code="too_many_connections")
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                                + body)
                transport.close()
                self.transport = transport
                return
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm()

        def _arm(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_overdue)

        def _headers_overdue(self) -> None:
            """No request under way (headers not yet complete): the connection is closed."""
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                if not self.transport.is_closing():
                    self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc) -> None:  # type: ignore[no-untyped-def]
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    return GuardedH11
