"""The frontend process: the HTTP app on uvicorn (uvloop), one BatonClient to the pipeline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn
import uvloop
import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.source import resolve_model
from baton.child_process import ReadyReporter, StartError
from baton.client import BatonClient
from baton.config import BatonConfig
from baton.frontend.app import create_app, served_model_name
from baton.frontend.drain import DrainingServer
from baton.frontend.http_protocol import OpenAIErrorHttpProtocol
from baton.generation_defaults import load_sampling_defaults
from baton.zmq_curve import server_as_client

logger = logging.getLogger(__name__)

# The detokenizer answers the client's handshake once it is up; on a cold machine the
# pipeline's processes can take a while to import and load.
CONNECT_TIMEOUT_S = 300.0
# After the drain (drain.py), connections still writing their last chunks may hold up uvicorn's
# shutdown this long.
GRACEFUL_SHUTDOWN_S = 2
STARTED_POLL_S = 0.05


class FrontendStartError(StartError):
    """uvicorn exited before serving (port taken, or the pipeline never answered)."""


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Serve HTTP until SIGTERM/SIGINT (then exit cleanly, via run_child's handlers)."""
    # Where the model is and its config.json: the frontend needs its name and context length,
    # not its tokenizer (the tokenizer and detokenizer processes hold that).
    source = resolve_model(config.model)
    curve = server_as_client(config)  # on --zmq-port under CurveZMQ, the server's own keys

    async def connect() -> BatonClient:
        client = BatonClient(addresses.requests, addresses.replies, curve=curve)
        await client.connect(CONNECT_TIMEOUT_S)
        return client

    max_model_len = source.load_config().served_context_length(config.max_model_len)
    defaults = load_sampling_defaults(config, announce=True)
    app = create_app(config, connect, max_model_len, source.name, defaults)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http=OpenAIErrorHttpProtocol,
            log_level=config.log_level.lower(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ),
        app.state.frontend,
        config.shutdown_timeout,
    )
    model = served_model_name(config, source.name)
    uvloop.run(_serve_until_stopped(server, lambda url: reporter.ready(http=url, model=model)))


async def _serve_until_stopped(server: uvicorn.Server, on_started: Callable[[str], None]) -> None:
    """Run uvicorn; once it listens, call `on_started` with its URL.

    uvicorn catches SIGTERM itself, drains and shuts down (drain.py), then re-raises the signal,
    so run_child's handler still ends the process with exit code 0.
    """
    serving = asyncio.ensure_future(_serve(server))
    while not server.started:
        if serving.done():
            serving.result()  # raises why it stopped
            raise FrontendStartError("uvicorn stopped before it started serving")
        await asyncio.sleep(STARTED_POLL_S)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    on_started(f"http://{host}:{port}")
    await serving


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as stopped:
        if not server.started:  # uvicorn exits on a startup failure; make it an error
            host, port = server.config.host, server.config.port
            raise FrontendStartError(
                f"the HTTP server could not start on {host}:{port} (uvicorn's error is above)"
            ) from stopped
        raise
