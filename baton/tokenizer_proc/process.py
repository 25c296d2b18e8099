"""The tokenizer process: validates and tokenizes client requests, then forwards them.

Clients' DEALER sockets reach this process's ROUTER. Valid requests go to the scheduler as
`TokenizedRequest`s; rejected ones go to the detokenizer as `RequestFailed`, because every reply
to a client comes from the detokenizer. Tokenizing here keeps long prompts off the scheduler's
loop. No input, however malformed, ends the loop: it becomes an error reply and a warning.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq
from jinja2 import TemplateError

from baton.addresses import ServerAddresses
from baton.chat_options import ChatOptions
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.tokenizer import Tokenizer
from baton.child_process import IDLE_POLL_MS, ReadyReporter
from baton.config import BatonConfig, SchedulingPolicy
from baton.messages import (
    PROMPT_TAIL_TOKENS,
    AbortRequest,
    AbortRid,
    ClientMessage,
    ErrorCode,
    ForwardedStatsRequest,
    GenerateRequest,
    PauseRequest,
    PauseRid,
    RequestFailed,
    RequestStarted,
    StatsRequest,
    TokenizedRequest,
    make_rid,
)
from baton.tokenizer_proc.chat import chat_prompt
from baton.tokenizer_proc.offload import Outgoing, PromptOffload
from baton.validation import (
    RequestError,
    check_prompt_chars,
    validate_chat_options,
    validate_deadline,
    validate_params,
    validate_priority,
    validate_prompt,
)

logger = logging.getLogger(__name__)

# A text prompt this long is tokenized on the worker thread (offload.py); shorter ones take
# milliseconds and are done on the loop, in order.
OFFLOAD_PROMPT_CHARS = 16_384


class TokenizerService:
    """Turns one client frame into the messages to send; owns no sockets, so tests need none."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        scheduling_policy: SchedulingPolicy,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduling_policy = scheduling_policy
        # A text longer than this cannot fit the context: refused before tokenizing, which for
        # a multi-megabyte prompt took seconds while every other request waited.
        self.max_prompt_chars = max_model_len * tokenizer.max_chars_per_token
        self._decoder = msgspec.msgpack.Decoder(ClientMessage)
        # Set by `serve`: large prompts go to a worker thread.
        self.offload: PromptOffload | None = None

    def start_offload(self) -> None:
        """Tokenize prompts of OFFLOAD_PROMPT_CHARS or more on a worker thread from now on."""
        # The tokenizer is shared: the `tokenizers` library encodes from any thread at once.
        worker = TokenizerService(
            self.tokenizer, self.vocab_size, self.max_model_len, self.scheduling_policy
        )
        self.offload = PromptOffload(worker.tokenize)

    @classmethod
    def from_config(cls, config: BatonConfig) -> TokenizerService:
        """Load the model's tokenizer and limits (no weights are read)."""
        checkpoint = load_checkpoint(config.model)
        max_model_len = checkpoint.config.served_context_length(config.max_model_len)
        return cls(
            checkpoint.tokenizer,
            checkpoint.config.vocab_size,
            max_model_len,
            config.scheduling_policy,
        )

    def handle_multipart(self, parts: list[bytes]) -> list[Outgoing]:
        """Handle what the ROUTER received: the client's routing id, then exactly one frame."""
        client_id, frames = parts[0], parts[1:]
        if len(frames) != 1:
            logger.warning("client %s sent %d frames; expected 1", client_id.hex(), len(frames))
            text = f"expected one message frame, got {len(frames)}"
            return [_failure(client_id, "", "invalid_request", text)]
        return self.handle(client_id, frames[0])

    def handle(self, client_id: bytes, frame: bytes) -> list[Outgoing]:
        """The messages one client frame produces, each with its destination socket."""
        try:
            message = self._decoder.decode(frame)
        # Any exception, not only msgspec's own: invalid UTF-8 raises UnicodeDecodeError.
        except Exception as error:
            logger.warning("client %s: malformed frame: %s", client_id.hex(), error)
            request_id = _recover_request_id(frame)
            text = f"malformed message: {error}"
            return [_failure(client_id, request_id, "invalid_request", text)]
        if not message.request_id:
            logger.warning("client %s: empty request_id", client_id.hex())
            return [_failure(client_id, "", "invalid_request", "request_id must be non-empty")]
        rid = make_rid(client_id, message.request_id)
        if isinstance(message, AbortRequest | PauseRequest):
            forward: Outgoing = (
                ("scheduler", AbortRid(rid=rid, reason=message.reason))
                if isinstance(message, AbortRequest)
                else ("scheduler", PauseRid(rid=rid, paused=message.paused))
            )
            held = self.offload is not None and self.offload.defer(rid, forward)
            return [] if held else [forward]
        if isinstance(message, StatsRequest):
            stats = ForwardedStatsRequest(client_id=client_id, request_id=message.request_id)
            return [("scheduler", stats)]
        if self.offload is None:
            return [self.tokenize(client_id, message)]
        if self.offload.holds(rid):
            # Refused here, not by the scheduler: it has not seen the first request yet, and an
            # abort held for the first would otherwise reach this one.
            text = f"request_id {message.request_id!r} is already running"
            return [_failure(client_id, message.request_id, "invalid_request", text)]
        if prompt_chars(message) < OFFLOAD_PROMPT_CHARS:
            return [self.tokenize(client_id, message)]
        self.offload.submit(rid, client_id, message)
        return []

    def tokenize(self, client_id: bytes, message: GenerateRequest) -> Outgoing:
        """The request, validated and tokenized for the scheduler, or its rejection."""
        try:
            prompt_ids = self._validated_prompt(message)
        except RequestError as error:
            logger.warning("request %r rejected: %s", message.request_id, error)
            return _failure(client_id, message.request_id, error.code, str(error))
        except Exception as error:  # a bug (e.g. in a tokenizer) must cost one request, not all
            logger.exception("client %s: request %r failed", client_id.hex(), message.request_id)
            return _failure(client_id, message.request_id, "internal", f"internal error: {error}")
        rid = make_rid(client_id, message.request_id)
        params = message.params
        started = RequestStarted(
            rid=rid,
            client_id=client_id,
            request_id=message.request_id,
            prompt_tokens=len(prompt_ids),
            prompt_tail=prompt_ids[-PROMPT_TAIL_TOKENS:],
            stop=list(params.stop or ()),
            skip_special_tokens=message.skip_special_tokens,
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            return_stats=message.return_stats,
        )
        tokenized = TokenizedRequest(
            rid=rid,
            prompt_token_ids=prompt_ids,
            params=msgspec.structs.replace(params, stop=None),
            arrival_time=time.monotonic(),
            started=started,
            priority=message.priority,
            deadline_ms=message.deadline_ms,
        )
        return ("scheduler", tokenized)

    def _validated_prompt(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; RequestError if the request cannot be served."""
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(request, name) is not None
        ]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise RequestError(
                f"exactly one of prompt, prompt_token_ids and messages must be set (got {found})"
            )
        validate_params(request.params, self.vocab_size)
        validate_priority(request.priority, self.scheduling_policy)
        validate_deadline(request.deadline_ms)
        if request.messages is None and request.chat != ChatOptions():
            raise RequestError("chat options (`chat`) need `messages`")
        validate_chat_options(request.chat)
        prompt_ids = self._prompt_ids(request)
        validate_prompt(prompt_ids, request.params.max_tokens, self.vocab_size, self.max_model_len)
        return prompt_ids

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if request.prompt is not None:
            text, add_special_tokens = request.prompt, request.add_special_tokens
        else:
            assert request.messages is not None  # exactly one prompt field is set
            try:
                chat = chat_prompt(self.tokenizer, request.messages, request.chat)
            except (ValueError, TemplateError) as error:
                raise RequestError(f"invalid messages: {error}") from error
            text, add_special_tokens = chat.text, chat.add_special_tokens
        # The rendered text, not the messages: a kwarg the template writes (a 4 MB bos_token)
        # makes it longer. Refused before tokenizing, which for megabytes takes seconds.
        check_prompt_chars(len(text), self.max_prompt_chars, self.max_model_len)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prompt_chars(request: GenerateRequest) -> int:
    """About the characters of the prompt a request's text or messages make (0 for token
    ids), counted without rendering: what decides whether it is tokenized on the worker."""
    texts = [request.prompt] if request.prompt is not None else []
    texts += [message.content for message in request.messages or ()]
    chars = sum(len(text) for text in texts)
    if request.messages is not None:
        # The kwargs a template may write into the prompt: their encoded size (msgpack, not
        # JSON: they are not validated yet, and a ZMQ client's may hold values JSON has not).
        chars += len(msgspec.msgpack.encode(request.chat))
    return chars


def _failure(client_id: bytes, request_id: str, code: ErrorCode, message: str) -> Outgoing:
    failed = RequestFailed(client_id=client_id, request_id=request_id, code=code, message=message)
    return ("detokenizer", failed)


def _recover_request_id(frame: bytes) -> str:
    """The frame's "request_id" if it is msgpack with a string one, else "" (best effort)."""
    try:
        content = msgspec.msgpack.decode(frame)
    except Exception:  # anything, even RecursionError on deeply nested garbage
        return ""
    if isinstance(content, dict) and isinstance(content.get("request_id"), str):
        return content["request_id"]
    return ""


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind the client-facing ROUTER, connect to the scheduler and detokenizer, loop until
    terminated (SIGTERM, from the launcher)."""
    service = TokenizerService.from_config(config)
    requests = context.socket(zmq.ROUTER)
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
