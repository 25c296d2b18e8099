"""Routes that describe the server: `GET /v1/models`, `GET /server_info`, `GET /health`,
`GET /metrics`, `GET /version`."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

import msgspec
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from baton.client import ServerError
from baton.frontend.errors import OpenAIError, json_response
from baton.frontend.state import SHUTTING_DOWN, FrontendState, frontend_state
from baton.scheduler_stats import AggregateStats

router = APIRouter()
# A stats round trip crosses all three pipeline processes; on a live server it takes
# milliseconds, so a pipeline silent for this long is not serving.
STATS_TIMEOUT_S = 2.0


async def scheduler_stats(state: FrontendState) -> AggregateStats | None:
    """The scheduler's stats, or None if the pipeline does not answer in time."""
    if state.client is None:
        return None
    try:
        return await asyncio.wait_for(state.client.stats(), STATS_TIMEOUT_S)
    except (asyncio.TimeoutError, ServerError):
        return None


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The one served model."""
    state = frontend_state(request)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "baton",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    return json_response({"object": "list", "data": [model]})


@router.get("/version")
async def server_version() -> Response:
    """The server's version (vLLM's route); with --api-key it needs the key (auth.py)."""
    try:
        installed = version("baton")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "unknown"
    return json_response({"version": installed})


@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """The machine, the engine's compute plan on it, and the scheduler's state (SGLang's
    /server_info): what a benchmark records beside its figures."""
    state = frontend_state(request)
    stats = await scheduler_stats(state)
    if stats is None:
        raise OpenAIError(503, "the pipeline is not answering")
    scheduler = msgspec.to_builtins(stats)
    return json_response(
        {
            "model": state.model_name,
            "max_model_len": state.max_model_len,
            "sampling_defaults": msgspec.to_builtins(state.sampling_defaults),
            "cpu": scheduler.pop("cpu"),
            "compute_plan": scheduler.pop("compute_plan"),
            "scheduler": scheduler,
        }
    )


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when every pipeline process answers (a stats round trip) and no engine step has run
    past --watchdog-timeout, else 503 (also while shutting down, so load balancers stop sending
    requests)."""
    state = frontend_state(request)
    if state.draining:
        raise OpenAIError(503, SHUTTING_DOWN)
    stats = await scheduler_stats(state)
    if stats is None:
        raise OpenAIError(503, "the pipeline is not answering")
    if stats.engine_step_seconds > state.watchdog_timeout:
        raise OpenAIError(
            503,
            f"an engine step has run for {stats.engine_step_seconds:.1f} s, past "
            f"--watchdog-timeout ({state.watchdog_timeout:g} s)",
        )
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition; scheduler gauges are left out while the pipeline is silent."""
    state = frontend_state(request)
    stats = await scheduler_stats(state)
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)
