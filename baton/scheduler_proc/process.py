"""The scheduler process: owns the engine, runs the scheduler core's loop, talks ZMQ."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

import zmq

from baton.addresses import ServerAddresses
from baton.child_process import IDLE_POLL_MS, ReadyReporter, run_child
from baton.config import BatonConfig
from baton.distributed.errors import DistributedError
from baton.distributed.process_group import Ranks, join_ranks, leave
from baton.engine.batch.forward_batch import ForwardOutput
from baton.messages import Codec
from baton.process_messages import (
    AbortRid,
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
from baton.scheduler_proc.replica_load import LoadReporter
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.stats_log import StatsLog
from baton.validation import RequestError

logger = logging.getLogger(__name__)

# How long the scheduler waits on the engine before it answers stats requests mid-step. A decode
# step is milliseconds and pays nothing for this; a prefill step can take seconds, and /health
# (a stats round trip) must not read a busy server as a dead one.
STATS_MID_STEP_AFTER_S = 0.05


class SchedulerService:
    """Turns incoming messages into scheduler calls and scheduler outputs into messages.

    While the engine computes a long step, stats requests are answered at once and every other
    message waits, in order, for the step's end: the scheduler core is never re-entered mid-step.

    With several ranks (tensor-parallel, pipeline stages), every rank runs this loop over the
    same messages in the same order, so each makes the same decisions and computes its shard or
    its stage of the same batches: rank 0
    alone reads the inbox and broadcasts what it took at the top of each iteration (an empty
    list keeps an idle server's ranks in step), and alone sends replies (`inbox` and `outbox`
    are None on the others). Stats requests only read the scheduler: rank 0 answers them.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        inbox: zmq.Socket | None,
        outbox: zmq.Socket | None,
        ranks: Ranks | None = None,
        loads: LoadReporter | None = None,
        replica: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.watchdog_timeout = scheduler.config.watchdog_timeout
        # When the scheduler began waiting on the engine's current step (None between steps).
        self._waiting_since: float | None = None
        self.started: list[RequestStarted] = []
        self.shutting_down = False
        self._inbox = inbox
        self._outbox = outbox
        self._ranks = ranks or Ranks()
        self._loads = loads
        self._replica = replica  # its data-parallel replica, named in its stats
        self._inbound = Codec(SchedulerMessage)
        self._broadcast = Codec(list[SchedulerMessage])
        self._outbound = Codec(DetokenizerMessage)
        self._stats_log = (
            None
            if scheduler.config.disable_log_stats
            else StatsLog(scheduler.aggregate_stats, time.monotonic())
        )
        self._deferred: deque[SchedulerMessage] = deque()
        # The engine thread writes a byte here when the step being waited on ends.
        self._step_done_read, self._step_done_write = os.pipe()
        self._poller = zmq.Poller()
        if inbox is not None:
            self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(self._step_done_read, zmq.POLLIN)

    def run(self) -> None:
        """Serve until a Shutdown message."""
        while not self.shutting_down:
            for message in self._next_messages():
                self._handle_and_reply(message)
            if self.started:  # before the step: a client hears of admission before its prefill
                self._send(SchedulerOutputs(started=self.started))
                self.started = []
            outputs = self.step()
            if outputs is not None:
                self._send(outputs)
            if self._stats_log is not None and self._ranks.is_first:
                self._stats_log.maybe_log(time.monotonic())
            if self._loads is not None:
                self._loads.report(self.scheduler.held_tokens())

    def _next_messages(self) -> list[SchedulerMessage]:
        """What this iteration applies, in order: the messages deferred through the last step,
        then those arrived since (stats requests answered at once instead); on the other ranks,
        what rank 0 broadcast."""
        if not self._ranks.is_first:
            messages = self._broadcast.decode_or_none(self._ranks.broadcast(None))
            if messages is None:  # rank 0 encoded them: only a broken transport gets here
                raise DistributedError(f"rank {self._ranks.rank}: an unreadable broadcast")
            return messages
        messages = list(self._deferred)
        self._deferred.clear()
        # Block only when idle; while requests run, just drain what has arrived.
        idle = not messages and not self.scheduler.has_runnable_work()
        while self._inbox.poll(IDLE_POLL_MS if idle else 0):
            idle = False
            message = self._receive()
            if isinstance(message, ForwardedStatsRequest):
                self._handle_and_reply(message)
            elif message is not None:
                messages.append(message)
        if self._ranks.size > 1:
            self._ranks.broadcast(self._broadcast.encode(messages))
        return messages

    def _send(self, message: DetokenizerMessage) -> None:
        if self._outbox is None:
            return
        self._outbox.send(self._outbound.encode(message))
        if self._loads is not None and isinstance(message, SchedulerOutputs):
            self._loads.finished += [step.rid for step in message.steps if step.finished]

    def _receive(self) -> SchedulerMessage | None:
        """The next inbox message (one is waiting), or None for a malformed frame."""
        return self._inbound.decode_or_none(self._inbox.recv())

    def _handle_and_reply(self, message: SchedulerMessage) -> None:
        reply = self.handle(message)
        if reply is not None:
            self._send(reply)

    def _answer_stats_until_done(self, result: Future[ForwardOutput]) -> None:
        """Wait for the engine's `result`, answering stats requests if it takes long."""
        self._waiting_since = time.monotonic()
        try:
            result.exception(timeout=STATS_MID_STEP_AFTER_S)
        except FutureTimeoutError:  # not the builtin TimeoutError before Python 3.11
            self._answer_stats_through_a_long_step(result)
        finally:
            self._waiting_since = None

    def _answer_stats_through_a_long_step(self, result: Future[ForwardOutput]) -> None:
        result.add_done_callback(lambda _: os.write(self._step_done_write, b"\0"))
        overdue = False
        while not result.done():
            # Bounded, as every loop of a child process is (child_process.IDLE_POLL_MS).
            ready = dict(self._poller.poll(IDLE_POLL_MS))
            if not overdue and self._step_seconds() > self.watchdog_timeout:
                overdue = True
                logger.error(
                    "an engine step has run past --watchdog-timeout (%g s); /health answers 503 "
                    "until it ends",
                    self.watchdog_timeout,
                )
            if self._inbox not in ready:
                continue
            while self._inbox.poll(0):
                message = self._receive()
                if isinstance(message, ForwardedStatsRequest):
                    self._handle_and_reply(message)
                elif message is not None:
                    self._deferred.append(message)
        os.read(self._step_done_read, 1)  # the callback's byte: written once `result` is done
        if overdue:
            logger.warning("the overdue engine step ended after %.1f s", self._step_seconds())

    def _step_seconds(self) -> float:
        """How long the scheduler has been waiting on the engine's current step (0: it is not)."""
        since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    def handle(self, message: SchedulerMessage) -> DetokenizerMessage | None:
        """Apply one message; returns an immediate reply for the detokenizer, if any."""
        if isinstance(message, TokenizedRequest):
            return self._add(message)
        if isinstance(message, AbortRid):
            self.scheduler.abort_request(message.rid, message.reason)
        elif isinstance(message, PauseRid):
            self.scheduler.set_paused(message.rid, message.paused, message.holder)
        elif isinstance(message, ForwardedStatsRequest):
            stats = self.scheduler.aggregate_stats()
            stats.engine_step_seconds = self._step_seconds()
            stats.replica = self._replica
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
                request.reasoning_end_token,
                client=request.started.client_id,
            )
        except RequestError as error:
            if self._loads is not None:
                self._loads.finished.append(request.rid)
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
        if self.scheduler.has_runnable_work():
            steps = self.scheduler.step(self._answer_stats_until_done)
        else:
            steps = []
        if not steps and not self.started:
            return None
        outputs = SchedulerOutputs(started=self.started, steps=steps)
        self.started = []
        return outputs


def serve(
    config: BatonConfig,
    addresses: ServerAddresses,
    context: zmq.Context,
    reporter: ReadyReporter,
    replica: int = 0,
    rank: int = 0,
) -> None:
    """Join the replica's other ranks (if any), bind (rank 0: the scheduler's address, or with
    several data-parallel replicas its replica's, behind the router), load the engine (this
    rank's shard of its stage), report ready, then loop until Shutdown."""
    ranks = join_ranks(
        rank,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        config.dist_init_addr or "",
        config.distributed_timeout_seconds,
        config.device,
    )
    try:
        inbox = outbox = loads = None
        replicated = config.data_parallel_size > 1
        if ranks.is_first:
            inbox = context.socket(zmq.PULL)
            inbox.bind(addresses.replica_inbox(replica) if replicated else addresses.scheduler)
            outbox = context.socket(zmq.PUSH)
            outbox.connect(addresses.detokenizer)
            if replicated:
                to_router = context.socket(zmq.PUSH)
                to_router.connect(addresses.balancer)
                loads = LoadReporter(to_router, replica)
        scheduler = Scheduler(config, ranks=ranks)
        engine = scheduler.engine
        service = SchedulerService(scheduler, inbox, outbox, ranks, loads, replica)
        reporter.ready(max_model_len=str(engine.max_model_len), num_pages=str(engine.num_pages))
        try:
            service.run()
        finally:
            scheduler.shutdown()
    finally:
        leave(ranks)


def main() -> None:
    """Entry point of `python -m baton.scheduler_proc`."""
    run_child("scheduler", serve, ranked=True)
