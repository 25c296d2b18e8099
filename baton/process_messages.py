"""The messages between the server's own processes: no client sends or receives them (the
client's side of the protocol, and the Codec that carries both, are in `messages.py`).

Flow: the tokenizer turns a client's `GenerateRequest` into a `TokenizedRequest` under a
server-wide `rid` (`make_rid`), with the `RequestStarted` that registers it with the
detokenizer, and passes the client's aborts, pauses and stats requests on to the scheduler
(`AbortRid`, `PauseRid`, `ForwardedStatsRequest`): its `SchedulerMessage`. The scheduler sends the
detokenizer (`DetokenizerMessage`) each iteration's `SchedulerOutputs` (the RequestStarted of the
requests it admitted, then their `StepOutput`s), its `ForwardedStats` and its refusals
(`RequestFailed`); the tokenizer sends the detokenizer its own refusals and the replies it
answers itself (`ForwardedTokenizeReply`). The detokenizer turns all of these into the client's
replies, and sends the scheduler an `AbortRid` when a stop string matches or a client vanishes,
and a `PauseRid` for a client whose replies wait unread.
The launcher ends both loops with `Shutdown`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from baton.messages import ErrorCode, FinishReason, TokenizeReply
from baton.sampling_params import SamplingParams
from baton.scheduler_stats import AggregateStats, RequestStats


def make_rid(client_id: bytes, request_id: str) -> str:
    """The server-wide id of a client's request (client ids are ZMQ routing ids)."""
    return f"{client_id.hex()}:{request_id}"


# The prompt tokens the detokenizer gets: enough left context to decode the first generated
# tokens right (incremental.py looks this far back for a clean cut between characters).
PROMPT_TAIL_TOKENS = 24


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Ask the scheduler or the detokenizer to leave its loop (sent by the launcher on stop, on
    their private sockets; clients cannot send it)."""


# --- what the scheduler reports each step (also the offline `LLM`'s outputs) --------------------
class TokenLogprob(msgspec.Struct, array_like=True):
    """The chosen token's log-probability and the top-n alternatives (id, logprob); a scored
    prompt token also has its rank in the distribution (1: the likeliest)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


class StepOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step; the last one carries finish reason and stats.
    Defaults stay off the wire: one of these crosses it per request per step."""

    rid: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    # Prompt tokens served by the prefix cache, sent with the request's first tokens: a stop
    # string can end the request downstream before the final output (and its stats) exists.
    cached_tokens: int | None = None
    # With `prompt_logprobs`, also with the first tokens: the prompt's tokens after its first.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def ends_on_stop_token(self) -> bool:
        """The scheduler finished the request on its last token: EOS or a stop_token_id (stop
        strings are matched downstream, by the detokenizer)."""
        return self.finished and self.finish_reason == "stop"


# --- tokenizer_proc / detokenizer_proc -> scheduler_proc ----------------------------------------
class RequestStarted(msgspec.Struct, tag="started", kw_only=True):
    """Registers a request with the detokenizer before any of its outputs (same socket: FIFO):
    whom to reply to, under the client's own `request_id`, and how to turn its tokens into
    text. Of the prompt, only its length and last few tokens (the context the first generated
    token is decoded in) cross the wire, or all of it when its tokens' logprobs are asked for."""

    rid: str
    client_id: bytes
    request_id: str
    prompt_tokens: int
    prompt_tail: list[int]
    stop: list[str]
    skip_special_tokens: bool
    min_tokens: int = 0  # stop strings are ignored until this many tokens are generated
    include_stop_str_in_output: bool = False
    return_stats: bool = False  # see GenerateRequest
    # A chat reply that opens inside the model's reasoning (--reasoning-parser): the frontend
    # learns it from the admission delta and reads the reply's text up to </think> as reasoning.
    in_reasoning: bool = False


class TokenizedRequest(msgspec.Struct, tag="tokenized", kw_only=True):
    """A validated request with its prompt as token ids; `rid` is unique server-wide and the one
    id below the tokenizer. `started` is the tokenizer's registration of the request with the
    detokenizer: the scheduler passes it on once it admits the request, reading only its
    `client_id` (the key of the client's share of the waiting queue, and where a refusal goes),
    so what only the detokenizer needs (stop strings, the client's own id) never rides through
    the scheduler's state."""

    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams  # without `stop`: stop strings are matched by the detokenizer
    arrival_time: float
    started: RequestStarted
    priority: int = 0
    deadline_ms: float | None = None
    # The token that ends the reasoning the reply opens in (`started.in_reasoning`): the
    # request's constraint, if any, applies only after it (engine/batch/grammar.py).
    reasoning_end_token: int | None = None


class AbortRid(msgspec.Struct, tag="abort_rid", kw_only=True):
    """Abort by server-wide id: a client's abort (via the tokenizer), a stop string or a vanished
    client (via the detokenizer)."""

    rid: str
    reason: FinishReason = "abort"


# Who holds a request paused: its client, whose reader is behind (a PauseRequest, through the
# tokenizer), or the server, where the client's replies wait unread (the detokenizer). Each
# lifts only its own hold, so neither resumes what the other paused: a client that never reads
# cannot resume itself, and a server catching up cannot resume a reader that is still behind.
PauseHolder = Literal["client", "server"]


class PauseRid(msgspec.Struct, tag="pause_rid", kw_only=True):
    """Pause or resume a request by server-wide id, for its client or for the server."""

    rid: str
    paused: bool
    holder: PauseHolder = "client"


class ForwardedStatsRequest(msgspec.Struct, tag="stats_fwd", kw_only=True):
    """A client's StatsRequest on its way to the scheduler."""

    client_id: bytes
    request_id: str


SchedulerMessage = TokenizedRequest | AbortRid | PauseRid | ForwardedStatsRequest | Shutdown


# --- scheduler_proc replicas -> router_proc (data parallelism) -----------------------------------
class ReplicaLoad(msgspec.Struct, tag="replica_load", kw_only=True):
    """A data-parallel replica's load, sent after each of its iterations that changed it, for
    the router's policies: the tokens its requests hold or wait to prefill, and the rids it has
    finished since its last report (the router forgets where they went)."""

    replica: int
    tokens: int
    finished: list[str] = []


# --- scheduler_proc / tokenizer_proc -> detokenizer_proc ----------------------------------------
class RequestFailed(msgspec.Struct, tag="failed", kw_only=True):
    """A request rejected before it started; relayed to its client as an ErrorReply."""

    client_id: bytes
    request_id: str
    code: ErrorCode
    message: str


class SchedulerOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """Everything one scheduler iteration produced, in order."""

    started: list[RequestStarted] = []
    steps: list[StepOutput] = []


class ForwardedStats(msgspec.Struct, tag="stats_out", kw_only=True):
    """The scheduler's answer to a ForwardedStatsRequest, on its way to the client."""

    client_id: bytes
    request_id: str
    stats: AggregateStats


class ForwardedTokenizeReply(msgspec.Struct, tag="tokenize_out", kw_only=True):
    """The tokenizer's TokenizeReply on its way to the client (every reply comes from the
    detokenizer)."""

    client_id: bytes
    reply: TokenizeReply


DetokenizerMessage = (
    SchedulerOutputs | RequestFailed | ForwardedStats | ForwardedTokenizeReply | Shutdown
)
