"""Errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.

Every failure the server answers goes through here, including FastAPI's own (unknown
route, wrong method, body validation, which FastAPI would answer 422: OpenAI says 400).
Bugs are answered 500 by middleware.UnexpectedErrorMiddleware.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raise from a handler to answer with this status and message."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503 for overload

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope; a 503 without a code of its own says service_unavailable."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    if code is None and status == 503:
        code = "service_unavailable"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)
