"""The scheduler process: owns the engine, runs the scheduler core's loop, talks ZMQ."""

from __future__ import annotations

import logging

import zmq

from baton.addresses import ServerAddresses
from baton.child_process import IDLE_POLL_MS, ReadyReporter, run_child
from baton.config import BatonConfig
from baton.messages import (
    AbortRid,
    Codec,
    DetokenizerMessage,
    ForwardedStats,
    ForwardedStatsRequest,
    PauseRid,
    RequestFailed,
    RequestStarted,
    SchedulerMessage,
    SchedulerOutputs,
    Shutdown,
    TokenizedRequest,
)
from baton.scheduler_proc.scheduler import Scheduler
from baton.validation import RequestError

logger = logging.getLogger(__name__)


class SchedulerService:
    """Turns incoming messages into scheduler calls and scheduler outputs into messages."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.started: list[RequestStarted] = []
        self.shutting_down = False

    def handle(self, message: SchedulerMessage) -> DetokenizerMessage | None:
        """Apply one message; returns an immediate reply for the detokenizer, if any."""
        if isinstance(message, TokenizedRequest):
            return self._add(message)
        if isinstance(message, AbortRid):
            self.scheduler.abort_request(message.rid, message.reason)
        elif isinstance(message, PauseRid):
            self.scheduler.set_paused(message.rid, message.paused)
        elif isinstance(message, ForwardedStatsRequest):
            stats = self.scheduler.aggregate_stats()
            return ForwardedStats(
                client_id=message.client_id, request_id=message.request_id, stats=stats
            )
        elif isinstance(message, Shutdown):
            self.shutting_down = True
        return None

    def _add(self, request: TokenizedRequest) -> RequestFailed | None:
        try:
            self.scheduler.add_request(
                request.rid,
                request.prompt_token_ids,
                request.params,
                request.arrival_time,
                request.priority,
                request.deadline_ms,
            )
        except RequestError as error:
            return RequestFailed(
                client_id=request.started.client_id,
                request_id=request.started.request_id,
                code=error.code,
                message=str(error),
            )
        self.started.append(request.started)
        return None

    def step(self) -> SchedulerOutputs | None:
        """One scheduler iteration; the outputs to send (registrations first), if any."""
        steps = self.scheduler.step() if self.scheduler.has_runnable_work() else []
        if not steps and not self.started:
            return None
        outputs = SchedulerOutputs(started=self.started, steps=steps)
        self.started = []
        return outputs


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind, load the engine, report ready, then loop until Shutdown."""
    inbox = context.socket(zmq.PULL)
    inbox.bind(addresses.scheduler)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(addresses.detokenizer)
    scheduler = Scheduler(config)
    engine = scheduler.engine
    service = SchedulerService(scheduler)
    inbound = Codec(SchedulerMessage)
    outbound = Codec(DetokenizerMessage)
    reporter.ready(max_model_len=str(engine.max_model_len), num_pages=str(engine.num_pages))
    try:
        while not service.shutting_down:
            # Block only when idle; while requests run, just drain what has arrived.
            idle = not scheduler.has_runnable_work()
            while inbox.poll(IDLE_POLL_MS if idle else 0):
                idle = False
                message = inbound.decode_or_none(inbox.recv())
                if message is None:
                    continue
                reply = service.handle(message)
                if reply is not None:
                    outbox.send(outbound.encode(reply))
            outputs = service.step()
            if outputs is not None:
                outbox.send(outbound.encode(outputs))
    finally:
        scheduler.shutdown()


def main() -> None:
    """Entry point of `python -m baton.scheduler_proc`."""
    run_child("scheduler", serve)
