"""The detokenizer process: runs the DetokenizerService on the scheduler's outputs and routes
every reply.

Each client has a DEALER (routing id = its `client_id`) connected to this process's ROUTER; replies
are batched per client per handled message (client_router.py routes them, and pauses the requests
of a client that does not read them).
"""

from __future__ import annotations

import logging
import time

import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.load import load_checkpoint
from baton.child_process import IDLE_POLL_MS, ReadyReporter
from baton.config import BatonConfig
from baton.detokenizer_proc.client_router import (
    BACKLOG_RETRY_S,
    ClientRouter,
    bind_client_router,
    readable,
)
from baton.detokenizer_proc.service import DetokenizerService
from baton.messages import HEARTBEAT_INTERVAL_S, Codec
from baton.process_messages import DetokenizerMessage, Shutdown

logger = logging.getLogger(__name__)


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind, report ready, then translate and route messages until Shutdown."""
    service = DetokenizerService(load_checkpoint(config.model).tokenizer, config.data_parallel_size)
    inbox = context.socket(zmq.PULL)
    inbox.bind(addresses.detokenizer)
    replies = bind_client_router(context, addresses.replies, config)
    to_scheduler = context.socket(zmq.PUSH)
    to_scheduler.connect(addresses.scheduler)
    router = ClientRouter(replies, service, to_scheduler)
    inbound: Codec[DetokenizerMessage] = Codec(DetokenizerMessage)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(replies, zmq.POLLIN)
    reporter.ready()
    next_heartbeat = next_retry = time.monotonic()
    while True:
        wait_s = BACKLOG_RETRY_S if router.stalled else HEARTBEAT_INTERVAL_S
        events = dict(poller.poll(min(IDLE_POLL_MS, int(wait_s * 1000))))
        if router.stalled and time.monotonic() >= next_retry:
            router.retry_backlogs()
            next_retry = time.monotonic() + BACKLOG_RETRY_S
        if time.monotonic() >= next_heartbeat:
            router.send_heartbeats()
            next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        if replies in events:
            router.answer_hellos()
        if inbox not in events:
            continue
        while readable(inbox):
            message = inbound.decode_or_none(inbox.recv())
            if isinstance(message, Shutdown):
                logger.info("shutting down")
                return
            if message is not None:
                router.deliver(service.handle_message(message))
