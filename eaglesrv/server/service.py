"""Service endpoints: /health, /health_generate, /metrics, /v1/models, /v1/models/{id}."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from eaglesrv.engine.client import EngineDeadError
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.server.errors import APIError, error_response
from eaglesrv.server.state import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0


def service_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 while serving; 503 while loading, shutting down, or with a dead engine."""
        if not state.serving:
            return error_response(503, state.not_serving_reason(), code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @router.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine has generated one token (SGLang's check of the whole path);
        503 if it cannot within HEALTH_GENERATE_TIMEOUT_S or is not serving."""
        release = state.admit(1)
        try:
            await asyncio.wait_for(_generate_one_token(state), HEALTH_GENERATE_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            return error_response(503, f"the engine did not generate a token: {exc or 'timed out'}")
        finally:
            release()
        return JSONResponse({"status": "ok"})

    if state.server_config.enable_metrics:

        @router.get("/metrics")
        async def metrics() -> Response:
            if state.info is not None and state.client.is_alive:
                try:
                    state.metrics.set_engine_stats(await state.client.stats())
                except (EngineDeadError, asyncio.TimeoutError):
                    pass  # scrape what we have; /health tells the rest
            return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        card = _model_card(state)
        if model_id not in (card["id"], card["root"]):
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return JSONResponse(card)

    return router


async def _generate_one_token(state: ServerState) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    async with aclosing(state.client.stream([0], params)) as outputs:
        async for _ in outputs:
            pass


def _model_card(state: ServerState) -> dict:
    info = state.require_serving()
    return {
        "id": info.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "eaglesrv",
        "root": info.model_path or info.model_name,
        "max_model_len": info.max_context_len,
    }
