"""The FastAPI app of the OpenAI-compatible frontend."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from baton.client import BatonClient
from baton.config import BatonConfig
from baton.frontend import chat, completions, info, responses, tokenization
from baton.frontend.auth import ApiKeyMiddleware
from baton.frontend.body_limit import BodySizeLimitMiddleware, default_body_limit
from baton.frontend.errors import install_error_handlers
from baton.frontend.metrics import FrontendMetrics
from baton.frontend.state import FrontendState
from baton.generation_defaults import SamplingDefaults

logger = logging.getLogger(__name__)

ClientFactory = Callable[[], Awaitable[BatonClient]]
SHUTDOWN_DRAIN_S = 1.0


def served_model_name(config: BatonConfig, checkpoint_name: str) -> str:
    """The model's name in the API: `served_model_name`, else the `--model` given, else (the
    default model) the checkpoint's name."""
    return config.served_model_name or config.model or checkpoint_name


def create_app(
    config: BatonConfig,
    connect: ClientFactory,
    max_model_len: int,
    checkpoint_name: str,
    sampling_defaults: SamplingDefaults | None = None,
) -> FastAPI:
    """The app; its lifespan connects the pipeline client with `connect` and closes it after.

    `max_model_len` is reported by /v1/models and bounds the default body size;
    `sampling_defaults` fill what requests leave unset (none: the API's own).
    """
    name = served_model_name(config, checkpoint_name)
    state = FrontendState(
        model_name=name,
        model_root=config.model or name,
        max_model_len=max_model_len,
        max_choices=config.max_running_requests
        + min(config.max_waiting_requests, config.max_queued_requests_per_client),
        watchdog_timeout=config.watchdog_timeout,
        created=int(time.time()),
        metrics=FrontendMetrics(name),
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        sampling_defaults=sampling_defaults or SamplingDefaults(),
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        reasoning_parser=config.reasoning_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = await connect()
        logger.info("connected to the pipeline; serving model %s", name)
        try:
            yield
        finally:
            # uvicorn has cancelled the requests still open; let them send their aborts before
            # the sockets close.
            if not await state.in_flight.drained(SHUTDOWN_DRAIN_S):
                logger.warning("%d requests still open at shutdown", state.in_flight.count)
            client, state.client = state.client, None
            await client.close()

    app = FastAPI(title="Baton", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.frontend = state
    for router in (
        completions.router,
        chat.router,
        responses.router,
        tokenization.router,
        info.router,
    ):
        app.include_router(router)
    install_error_handlers(app)
    # The last middleware added runs first: the key is checked before the body is read.
    body_limit = config.max_request_body_bytes or default_body_limit(max_model_len)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=body_limit)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    # Outermost: a browser's preflight needs no key, and a 401 carries the CORS headers the
    # browser needs to show it (vLLM's key check, outside its CORS, lets OPTIONS through).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
    return app
