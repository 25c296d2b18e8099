"""Graceful shutdown of the HTTP server, as vLLM's `--shutdown-timeout` does it.

The first SIGTERM (or SIGINT) starts a drain: new requests and /health get 503 with
`Retry-After`, open requests may finish for up to `shutdown_timeout` seconds, then those still
open are cut: a stream gets an error chunk and `[DONE]`, a plain request a 503. Only then does
uvicorn shut down. A second signal cuts at once.

The launcher's PIPELINE_LOST_SIGNAL (another child process died, so no open request can finish)
is the same shutdown allowing no time: every open request is cut at once, as "unavailable".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType

import uvicorn

from baton.child_process import PIPELINE_LOST_SIGNAL
from baton.frontend.state import SHUTTING_DOWN, FrontendState

logger = logging.getLogger(__name__)

PIPELINE_LOST = "the server is shutting down: one of its processes died"


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains `state` before uvicorn's own shutdown, and whose
    PIPELINE_LOST_SIGNAL cuts `state`'s open requests at once."""

    def __init__(self, config: uvicorn.Config, state: FrontendState, timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._timeout = timeout
        self._signal: int | None = None
        self._cut_now: asyncio.Event | None = None
        self._cut_message = SHUTTING_DOWN

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = signal.signal(PIPELINE_LOST_SIGNAL, self._pipeline_lost)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(PIPELINE_LOST_SIGNAL, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._shut_down(sig, frame, allowed=self._timeout)

    def _pipeline_lost(self, sig: int, frame: FrameType | None) -> None:
        # SIGTERM's shutdown (the process still exits 0 after it), with no time allowed: what
        # is open waits on a process that is gone. Cuts a drain already under way too.
        self._cut_message = PIPELINE_LOST
        self._shut_down(signal.SIGTERM, frame, allowed=0.0)

    def _shut_down(self, sig: int, frame: FrameType | None, allowed: float) -> None:
        """Drain for `allowed` seconds on the first signal, cut on the next."""
        # A signal handler runs between two bytecodes of the loop's own thread: hand the work
        # to the loop rather than touch its state from here.
        loop = asyncio.get_event_loop()
        if self._signal is None and self.started:
            self._signal = sig
            self._cut_now = asyncio.Event()
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(allowed)))
        elif self._cut_now is not None and not self._cut_now.is_set():
            loop.call_soon_threadsafe(self._cut_now.set)
        else:  # before serving, or after the drain: uvicorn's own handling
            super().handle_exit(sig, frame)

    async def _drain(self, allowed: float) -> None:
        state, cut_now = self._state, self._cut_now
        assert cut_now is not None and self._signal is not None
        state.draining = True
        if state.in_flight.count and allowed:
            logger.info(
                "shutting down: %d requests open, allowed %.0fs to finish; new ones get 503",
                state.in_flight.count,
                allowed,
            )
        wait_cut = asyncio.ensure_future(cut_now.wait())
        drained = asyncio.ensure_future(state.in_flight.drained(allowed))
        await asyncio.wait({wait_cut, drained}, return_when=asyncio.FIRST_COMPLETED)
        wait_cut.cancel()
        if not (drained.done() and drained.result()):
            drained.cancel()
            self._cut(state, self._cut_message)
        cut_now.set()  # from now on a signal is uvicorn's to handle
        super().handle_exit(self._signal, None)

    @staticmethod
    def _cut(state: FrontendState, message: str) -> None:
        if state.client is None:
            return
        cut = state.client.fail_open_requests("unavailable", message)
        if cut:
            logger.warning("shutting down: cut %d requests still open", cut)
