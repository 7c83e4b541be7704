"""ASGI middleware: web-origin check with CORS, API-key check and request-body size limit.

Plain ASGI (not BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac
import logging

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eaglesrv.server.errors import APIError, error_response

logger = logging.getLogger(__name__)

# Probes and scrapers usually carry no credentials (as in SGLang).
_UNAUTHENTICATED_PATHS = ("/health", "/metrics")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class OriginMiddleware:
    """Keep web pages from driving the server through a visitor's browser.

    A browser marks every cross-site request with an Origin header, and a `text/plain`
    POST needs no CORS preflight, so without this check any page could make a browser on
    this machine generate on localhost. Requests carrying an Origin that --allowed-origins
    does not list get 403; allowed ones get CORS headers, and their preflights an answer.
    Requests without an Origin (curl, SDKs, other servers) pass untouched, and so do the
    server's own pages (/docs) when served on a loopback address: the Origin then equals
    the Host, which a DNS-rebinding page cannot make a loopback address.
    """

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self._any = "*" in allowed_origins
        self._allowed = {origin.rstrip("/") for origin in allowed_origins}

    def _allows(self, origin: str, host: str) -> bool:
        if self._any or origin in self._allowed:
            return True
        hostname = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        return hostname in _LOOPBACK_HOSTS and origin in (f"http://{host}", f"https://{host}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        origin = headers.get(b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        origin_text = origin.decode("latin-1")
        if not self._allows(origin_text, headers.get(b"host", b"").decode("latin-1")):
            refusal = error_response(403, f"requests from the web origin {origin_text!r} are not allowed; "
                                          "list it in --allowed-origins to allow it", code="origin_not_allowed")
            await refusal(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            requested = headers.get(b"access-control-request-headers", b"authorization, content-type")
            preflight = Response(status_code=204, headers={
                "access-control-allow-origin": origin_text, "vary": "Origin",
                "access-control-allow-methods": "GET, POST, OPTIONS",
                "access-control-allow-headers": requested.decode("latin-1"), "access-control-max-age": "600"})
            await preflight(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


class APIKeyMiddleware:
    """Admit only requests with 'Authorization: Bearer <key>' (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNAUTHENTICATED_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            message = "missing API key" if not given else "invalid API key"
            response = error_response(401, f"{message}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """A bug answers 500 in OpenAI's envelope and logs one traceback. (An exception handler
    for Exception would run in Starlette's outermost layer, which re-raises afterwards, so
    uvicorn would log the same traceback a second time.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if not started:  # else the client sees the stream end early
                await error_response(500, f"internal error: {type(exc).__name__}")(scope, receive, send)


class RequestTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes", code="request_too_large")


class BodySizeLimitMiddleware:
    """Refuse bodies over `limit` bytes: at once from Content-Length, else while reading."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            refusal = error_response(413, RequestTooLarge(self._limit).message, code="request_too_large")
            await refusal(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._limit:
                    raise RequestTooLarge(self._limit)  # answered 413 by the APIError handler
            return message

        await self.app(scope, counting_receive, send)
