"""What the routes share: the pipeline client, the served model and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from starlette.requests import Request

from baton.client import BatonClient
from baton.frontend.errors import OpenAIError
from baton.frontend.metrics import FrontendMetrics
from baton.generation_defaults import SamplingDefaults

SHUTTING_DOWN = "the server is shutting down"


class InFlight:
    """Counts the pipeline requests in flight (streams, tokenize round trips), so shutdown can
    wait for them and for their aborts."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Count one request in flight for the block's duration."""
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Wait until none is in flight (False if `timeout` passed first)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


@dataclass
class FrontendState:
    """Per-app state; `client` is set once the app's lifespan has connected it."""

    model_name: str
    model_root: str
    max_model_len: int
    # Choices (prompts x n) one request may have: more could never all be admitted at once, as
    # the scheduler holds --max-running-requests running and --max-waiting-requests waiting, of
    # which the frontend, one client, may have --max-queued-requests-per-client.
    max_choices: int
    # /health answers 503 while one engine step has run longer than this (--watchdog-timeout).
    watchdog_timeout: float
    created: int
    metrics: FrontendMetrics
    client: BatonClient | None = None
    # --return-tokens-as-token-ids: what a request that does not say gets.
    return_tokens_as_token_ids: bool = False
    # What a request that leaves a sampling parameter unset gets (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # --tool-call-parser, under --enable-auto-tool-choice: None refuses tool_choice "auto".
    tool_call_parser: str | None = None
    # --reasoning-parser: chat replies carry `reasoning` apart from their content.
    reasoning_parser: str | None = None
    in_flight: InFlight = field(default_factory=InFlight)
    # Set once shutdown begins: open requests may finish, new ones are refused (see drain.py).
    draining: bool = False

    def require_client(self) -> BatonClient:
        """The connected client for a new request (503 while starting or shutting down)."""
        if self.draining:
            raise OpenAIError(503, SHUTTING_DOWN)
        if self.client is None:
            raise OpenAIError(503, "the server is not connected to its pipeline yet")
        return self.client

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprob tokens read "token_id:<id>": the request's choice, else the server's."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` is the served model (omitted means the served one)."""
        if requested is not None and requested != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{requested}` does not exist; this server serves `{self.model_name}`.",
                code="model_not_found",
                param="model",
            )


def frontend_state(request: Request) -> FrontendState:
    """The app's FrontendState."""
    return request.app.state.frontend
