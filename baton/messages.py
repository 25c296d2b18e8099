"""The client protocol: msgspec Structs in tagged unions, msgpack-encoded, one union per receiver.

Flow: client -> tokenizer_proc -> scheduler_proc -> detokenizer_proc -> client. A client sends a
`ClientMessage` to the tokenizer; every reply to it comes from the detokenizer (`ClientReply`),
routed by the client's ZMQ identity (`client_id`), so each client gets only its own replies. What
the server's processes send one another in between is in `process_messages.py`; the scheduler's
figures, which replies carry, in `scheduler_stats.py` (the launcher's own messages with its
children are in `child_process.py`). Never pickle: a frame that does not decode into the
receiver's union is logged and dropped (`decode_or_none`), it never kills a process.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Literal, TypeVar

import msgspec

from baton.chat_options import ChatOptions
from baton.sampling_params import SamplingParams
from baton.scheduler_stats import AggregateStats, RequestStats

logger = logging.getLogger(__name__)

# Why a request ended: EOS or a stop token/string, max_tokens or the context, an abort (client
# gone, cancelled), or a failure of its own (its sampling failed). msgspec refuses any other.
FinishReason = Literal["stop", "length", "abort", "error"]
# A typed error's kind; the frontend maps each to its HTTP status (frontend/errors.py).
ErrorCode = Literal["invalid_request", "prompt_too_long", "overloaded", "internal", "unavailable"]


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One chat turn, as in OpenAI's API: an assistant's turn may hold the tool calls it made
    (OpenAI's objects: id, type, function name and arguments as JSON text) and the reasoning
    that came before its content, and a "tool" turn answers the call `tool_call_id` names."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


# --- client -> tokenizer_proc -----------------------------------------------------------------
class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True):
    """Exactly one of `prompt`, `prompt_token_ids` and `messages` is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    # How `messages` are rendered (vLLM's chat template fields); only with `messages`.
    chat: ChatOptions = msgspec.field(default_factory=ChatOptions)
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    add_special_tokens: bool = True
    # For --scheduling-policy: vLLM's `priority` (lower runs first; other than 0 only under
    # the priority policy), and a deadline in ms from arrival (edf, lrs).
    priority: int = 0
    deadline_ms: float | None = None
    # The final reply carries the request's stats even when a stop string ended it: that
    # reply then waits for the scheduler's final output (one more step).
    return_stats: bool = False


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True):
    """Stop a request early; its final reply has finish_reason "abort" (or `reason`)."""

    request_id: str
    reason: FinishReason = "abort"


class PauseRequest(msgspec.Struct, tag="pause", kw_only=True):
    """Pause a request's generation (its pages are kept), or resume it: a client sends it when
    it is not reading the request's output as fast as it comes (`BatonClient`)."""

    request_id: str
    paused: bool


class StatsRequest(msgspec.Struct, tag="stats", kw_only=True):
    """Ask the scheduler for its aggregate stats; answered with a StatsReply."""

    request_id: str


class TokenizeRequest(msgspec.Struct, tag="tokenize", kw_only=True):
    """vLLM's /tokenize: the token ids of a text (`add_special_tokens`: BOS and the like) or of
    chat messages rendered under `chat`, and with `return_token_strs` their vocabulary entries;
    answered with a TokenizeReply. Exactly one of `prompt` and `messages` is set. Its
    `request_id`, as any request's, must not be that of one of the client's running requests:
    replies are routed by it."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions = msgspec.field(default_factory=ChatOptions)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, tag="detokenize", kw_only=True):
    """vLLM's /detokenize: the text of token ids (special tokens kept); answered with a
    TokenizeReply."""

    request_id: str
    token_ids: list[int]


ClientMessage = (
    GenerateRequest
    | AbortRequest
    | PauseRequest
    | StatsRequest
    | TokenizeRequest
    | DetokenizeRequest
)


# --- detokenizer_proc -> client -----------------------------------------------------------------
class Usage(msgspec.Struct, kw_only=True):
    """Token counts of a finished request, as OpenAI's `usage`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class TokenText(msgspec.Struct, array_like=True):
    """A token as a client sees it in logprobs: the text it adds in context, its bytes (a token
    holding part of a character has bytes but no text of its own) and its log-probability."""

    token_id: int
    text: str
    bytes: list[int]
    logprob: float


class LogprobEntry(msgspec.Struct, array_like=True):
    """A token and its top alternatives (most likely first); a scored prompt token's rank."""

    token: TokenText
    top: list[TokenText]
    rank: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """A prompt's tokens as a client sees them in logprobs: the first one's id and text
    (nothing precedes it to give it a probability), then an entry for each token after it."""

    first_token_id: int
    first_token: str
    entries: list[LogprobEntry]


class GenerateDelta(msgspec.Struct, tag="delta", kw_only=True, omit_defaults=True):
    """New output of one request; the last one has `finished`, `finish_reason`, usage and stats.
    The first, `admission`, carries nothing but `in_reasoning`: the scheduler took the request
    (sent before its prefill runs); with `prompt_logprobs`, the first with tokens carries them.
    Defaults stay off the wire (one delta a token)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stats: RequestStats | None = None
    # The request's first delta, and nothing else: the scheduler took it (an HTTP stream's
    # headers can go out now, as vLLM's do before the first token).
    admission: bool = False
    # On the admission delta: the reply opens inside the model's reasoning (a chat under
    # --reasoning-parser whose prompt left the block open), so its text up to the first
    # </think> is reasoning (baton/reasoning.py).
    in_reasoning: bool = False


class ErrorReply(msgspec.Struct, tag="error", kw_only=True):
    """A typed error: invalid_request | prompt_too_long | overloaded | internal."""

    request_id: str
    code: ErrorCode
    message: str


class StatsReply(msgspec.Struct, tag="stats_reply", kw_only=True):
    """Aggregate scheduler stats, answering a StatsRequest."""

    request_id: str
    stats: AggregateStats


class TokenizeReply(msgspec.Struct, tag="tokenize_reply", kw_only=True):
    """A text and its token ids: a TokenizeRequest's (the text as encoded: a chat's rendered
    prompt) or a DetokenizeRequest's."""

    request_id: str
    text: str
    token_ids: list[int]
    # Each id's vocabulary entry ("▁time", "<0xE2>"; None past the tokenizer's vocabulary),
    # when the TokenizeRequest asked for them.
    token_strs: list[str | None] | None = None


class Replies(msgspec.Struct, tag="replies"):
    """Replies for one client, batched per detokenizer iteration."""

    items: list[GenerateDelta | ErrorReply | StatsReply | TokenizeReply]


class Hello(msgspec.Struct, tag="hello"):
    """Sent by a client on its reply socket; answered with HelloAck once it is routable."""


class HelloAck(msgspec.Struct, tag="hello_ack"):
    """The detokenizer can now route replies to this client."""


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent to every connected client each HEARTBEAT_INTERVAL_S: the server is alive (a client
    whose open requests hear nothing for long fails them), and the send itself finds clients
    that are gone, even those whose requests are all paused and so get no replies."""


# How often the detokenizer sends each connected client a Heartbeat.
HEARTBEAT_INTERVAL_S = 1.0

ClientReply = Replies | HelloAck | Heartbeat
DetokenizerClientMessage = Hello


T = TypeVar("T")


class Codec(Generic[T]):
    """msgpack encoder/decoder for one receiver's union."""

    def __init__(self, union: type[T]) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: object) -> bytes:
        return self._encoder.encode(message)

    def decode_or_none(self, frame: bytes) -> T | None:
        """The decoded message, or None (logged) for a malformed frame."""
        try:
            return self._decoder.decode(frame)
        # Not only DecodeError/ValidationError: invalid UTF-8 in a msgpack string raises
        # UnicodeDecodeError, and any exception here would kill the receiving process.
        except Exception as error:
            logger.warning("dropping malformed frame (%d bytes): %r", len(frame), error)
            return None
