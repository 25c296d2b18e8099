"""The tokenizer process's socket-free core: validates and tokenizes client requests.

Clients' DEALER sockets reach this process's ROUTER. Valid requests go to the scheduler as
`TokenizedRequest`s; rejected ones go to the detokenizer as `RequestFailed`, and the answers to
/tokenize and /detokenize as `ForwardedTokenizeReply`, because every reply to a client comes
from the detokenizer. Tokenizing here keeps long prompts off the scheduler's
loop. No input, however malformed, ends the loop: it becomes an error reply and a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.tokenizer import Tokenizer
from baton.config import BatonConfig, SchedulingPolicy
from baton.messages import (
    AbortRequest,
    ClientMessage,
    DetokenizeRequest,
    ErrorCode,
    GenerateRequest,
    PauseRequest,
    StatsRequest,
    TokenizeReply,
    TokenizeRequest,
)
from baton.process_messages import (
    PROMPT_TAIL_TOKENS,
    AbortRid,
    ForwardedStatsRequest,
    ForwardedTokenizeReply,
    PauseRid,
    RequestFailed,
    RequestStarted,
    TokenizedRequest,
    make_rid,
)
from baton.tokenizer_proc.offload import Outgoing, PromptOffload, PromptRequest
from baton.tokenizer_proc.prompts import PromptReader, check_chat_options, prompt_chars
from baton.tokenizer_proc.reasoning import ReasoningTokens
from baton.validation import (
    RequestError,
    check_token_ids,
)

logger = logging.getLogger(__name__)
# The requests answered through `_answered`: each names its `request_id`.
Answerable = TypeVar("Answerable", GenerateRequest, TokenizeRequest, DetokenizeRequest)

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
        reasoning: ReasoningTokens | None = None,
    ) -> None:
        self.prompts = PromptReader(
            tokenizer, vocab_size, max_model_len, scheduling_policy, reasoning
        )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._decoder = msgspec.msgpack.Decoder(ClientMessage)
        # Set by `serve`: large prompts go to a worker thread.
        self.offload: PromptOffload | None = None

    def start_offload(self) -> None:
        """Tokenize prompts of OFFLOAD_PROMPT_CHARS or more on a worker thread from now on."""
        # `answer` reads only what never changes (the tokenizer, the limits), so the worker
        # runs it beside the loop.
        self.offload = PromptOffload(self.answer)

    @classmethod
    def from_config(cls, config: BatonConfig) -> TokenizerService:
        """Load the model's tokenizer and limits (no weights are read)."""
        checkpoint = load_checkpoint(config.model, config.chat_template)
        max_model_len = checkpoint.config.served_context_length(config.max_model_len)
        parser = config.reasoning_parser
        return cls(
            checkpoint.tokenizer,
            checkpoint.config.vocab_size,
            max_model_len,
            config.scheduling_policy,
            ReasoningTokens.of(checkpoint.tokenizer, parser) if parser else None,
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
        if isinstance(message, DetokenizeRequest):
            return [self._answered(client_id, self._detokenize, message)]
        if self.offload is None:
            return [self.answer(client_id, message)]
        if self.offload.holds(rid):
            # Refused here, not by the scheduler: it has not seen the first request yet, and an
            # abort held for the first would otherwise reach this one.
            text = f"request_id {message.request_id!r} is already running"
            return [_failure(client_id, message.request_id, "invalid_request", text)]
        if prompt_chars(message) < OFFLOAD_PROMPT_CHARS:
            return [self.answer(client_id, message)]
        self.offload.submit(rid, client_id, message)
        return []

    def answer(self, client_id: bytes, message: PromptRequest) -> Outgoing:
        """A request with a prompt, answered: a GenerateRequest validated, tokenized and
        forwarded to the scheduler, a TokenizeRequest's token ids sent back; or its rejection."""
        if isinstance(message, TokenizeRequest):
            return self._answered(client_id, self._tokenize, message)
        return self._answered(client_id, self._forward, message)

    def _answered(
        self, client_id: bytes, answer: Callable[[bytes, Answerable], Outgoing], message: Answerable
    ) -> Outgoing:
        """`answer(client_id, message)`, or the client's error reply if it raises."""
        request_id = message.request_id
        try:
            return answer(client_id, message)
        except RequestError as error:
            logger.warning("request %r rejected: %s", request_id, error)
            return _failure(client_id, request_id, error.code, str(error))
        except Exception as error:  # a bug (e.g. in a tokenizer) must cost one request, not all
            logger.exception("client %s: request %r failed", client_id.hex(), request_id)
            return _failure(client_id, request_id, "internal", f"internal error: {error}")

    def _tokenize(self, client_id: bytes, message: TokenizeRequest) -> Outgoing:
        if (message.prompt is None) == (message.messages is None):
            raise RequestError("exactly one of prompt and messages must be set")
        check_chat_options(message)
        text, add_special_tokens = self.prompts.prompt_text(message)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        reply = TokenizeReply(request_id=message.request_id, text=text, token_ids=token_ids)
        if message.return_token_strs:
            reply.token_strs = [self.tokenizer.id_to_token(token) for token in token_ids]
        return ("detokenizer", ForwardedTokenizeReply(client_id=client_id, reply=reply))

    def _detokenize(self, client_id: bytes, message: DetokenizeRequest) -> Outgoing:
        # Bounded as a prompt is: a ZMQ frame of millions of ids would hold up the loop.
        if len(message.token_ids) > self.max_model_len:
            raise RequestError(f"at most {self.max_model_len} token ids (the context length)")
        check_token_ids(message.token_ids, self.vocab_size, "token_ids")
        text = self.tokenizer.decode(message.token_ids, skip_special_tokens=False)
        reply = TokenizeReply(request_id=message.request_id, text=text, token_ids=message.token_ids)
        return ("detokenizer", ForwardedTokenizeReply(client_id=client_id, reply=reply))

    def _forward(self, client_id: bytes, message: GenerateRequest) -> Outgoing:
        prompt_ids = self.prompts.validated_prompt(message)
        rid = make_rid(client_id, message.request_id)
        params = message.params
        reasoning_end = self.prompts.reasoning_end(message, prompt_ids)
        started = RequestStarted(
            rid=rid,
            client_id=client_id,
            request_id=message.request_id,
            prompt_tokens=len(prompt_ids),
            prompt_tail=prompt_ids
            if params.prompt_logprobs is not None
            else prompt_ids[-PROMPT_TAIL_TOKENS:],
            stop=list(params.stop or ()),
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            return_stats=message.return_stats,
            in_reasoning=reasoning_end is not None,
        )
        tokenized = TokenizedRequest(
            rid=rid,
            prompt_token_ids=prompt_ids,
            params=msgspec.structs.replace(params, stop=None),
            arrival_time=time.monotonic(),
            started=started,
            priority=message.priority,
            deadline_ms=message.deadline_ms,
            reasoning_end_token=reasoning_end,
        )
        return ("scheduler", tokenized)


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
