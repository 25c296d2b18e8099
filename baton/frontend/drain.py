"""Graceful shutdown of the HTTP server, as vLLM's `--shutdown-timeout` does it.

The first SIGTERM (or SIGINT) starts a drain: new requests and /health get 503 with
`Retry-After`, open requests may finish for up to `shutdown_timeout` seconds, then those still
open are cut: a stream gets an error chunk and `[DONE]`, a plain request a 503. Only then does
uvicorn shut down. A second signal cuts at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from baton.frontend.state import SHUTTING_DOWN, FrontendState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains `state` before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, state: FrontendState, timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._timeout = timeout
        self._signal: int | None = None
        self._cut_now: asyncio.Event | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the loop's own thread: hand the work
        # to the loop rather than touch its state from here.
        loop = asyncio.get_event_loop()
        if self._signal is None and self.started:
            self._signal = sig
            self._cut_now = asyncio.Event()
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        elif self._cut_now is not None and not self._cut_now.is_set():
            loop.call_soon_threadsafe(self._cut_now.set)
        else:  # before serving, or after the drain: uvicorn's own handling
            super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        state, cut_now = self._state, self._cut_now
        assert cut_now is not None and self._signal is not None
        state.draining = True
        if state.in_flight.count:
            logger.info(
                "shutting down: %d requests open, allowed %.0fs to finish; new ones get 503",
                state.in_flight.count,
                self._timeout,
            )
        wait_cut = asyncio.ensure_future(cut_now.wait())
        drained = asyncio.ensure_future(state.in_flight.drained(self._timeout))
        await asyncio.wait({wait_cut, drained}, return_when=asyncio.FIRST_COMPLETED)
        wait_cut.cancel()
        if not (drained.done() and drained.result()):
            drained.cancel()
            self._cut(state)
        cut_now.set()  # from now on a signal is uvicorn's to handle
        super().handle_exit(self._signal, None)

    @staticmethod
    def _cut(state: FrontendState) -> None:
        if state.client is None:
            return
        cut = state.client.fail_open_requests("unavailable", SHUTTING_DOWN)
        logger.warning("shutting down: cut %d requests still open", cut)
