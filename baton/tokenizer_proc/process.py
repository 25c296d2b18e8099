"""The tokenizer process: runs the TokenizerService on client frames and sends what it
produces to the scheduler or the detokenizer; large prompts are tokenized on a worker thread."""

from __future__ import annotations

import msgspec
import zmq

from baton.addresses import ServerAddresses
from baton.child_process import IDLE_POLL_MS, ReadyReporter
from baton.config import BatonConfig
from baton.tokenizer_proc.service import TokenizerService
from baton.zmq_curve import secure_client_facing


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind the client-facing ROUTER, connect to the scheduler and detokenizer, loop until
    terminated (SIGTERM, from the launcher)."""
    service = TokenizerService.from_config(config)
    requests = context.socket(zmq.ROUTER)
    secure_client_facing(requests, context, config)
    requests.bind(addresses.requests)
    outboxes = {
        "scheduler": context.socket(zmq.PUSH),
        "detokenizer": context.socket(zmq.PUSH),
    }
    outboxes["scheduler"].connect(addresses.scheduler)
    outboxes["detokenizer"].connect(addresses.detokenizer)
    encoder = msgspec.msgpack.Encoder()
    service.start_offload()
    assert service.offload is not None
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    poller.register(service.offload.wake_fd, zmq.POLLIN)
    reporter.ready(max_model_len=str(service.max_model_len))
    while True:
        ready = dict(poller.poll(IDLE_POLL_MS))
        outgoing = service.offload.completed() if service.offload.wake_fd in ready else []
        if requests in ready:
            outgoing += service.handle_multipart(requests.recv_multipart())
        for destination, message in outgoing:
            outboxes[destination].send(encoder.encode(message))
