"""The FastAPI application: routes, error envelopes and middleware around one ServerState."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import eaglesrv
from eaglesrv.engine.client import EngineDeadError
from eaglesrv.scheduler import RequestRejected
from eaglesrv.server.chat import chat_router
from eaglesrv.server.completions import completions_router
from eaglesrv.server.errors import error_response, install_error_handlers
from eaglesrv.server.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    OriginMiddleware,
    UnexpectedErrorMiddleware,
)
from eaglesrv.server.native import native_router
from eaglesrv.server.service import service_router
from eaglesrv.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="eaglesrv", version=eaglesrv.__version__, docs_url="/docs", redoc_url=None)
    for router in (service_router(state), chat_router(state), completions_router(state), native_router(state)):
        app.include_router(router)
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="service_unavailable")

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return error_response(400, str(exc))

    # Added last = outermost: the origin check runs first, then the size limit, then the key,
    # then the catch-all for bugs.
    app.add_middleware(UnexpectedErrorMiddleware)
    if state.server_config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.server_config.api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=state.server_config.max_request_bytes)
    app.add_middleware(OriginMiddleware, allowed_origins=state.server_config.allowed_origins)
    return app
