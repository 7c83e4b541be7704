"""ASGI middleware: API-key check and request-body size limit.

Plain ASGI (not BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eaglesrv.server.errors import APIError, error_response

# Probes and scrapers usually carry no credentials (as in SGLang).
_UNAUTHENTICATED_PATHS = ("/health", "/metrics")


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
