"""The detokenizer's socket-free core: scheduler outputs in, each client's text deltas out.

A stop string is detected here, so the client gets its final delta at once and the scheduler is
told to abort the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.checkpoint.tokenizer import Tokenizer
from baton.detokenizer_proc.incremental import IncrementalDetokenizer
from baton.detokenizer_proc.logprob_text import LogprobTexts
from baton.messages import ErrorReply, GenerateDelta, StatsReply, TokenizeReply, Usage
from baton.process_messages import (
    AbortRid,
    DetokenizerMessage,
    ForwardedStats,
    ForwardedTokenizeReply,
    RequestFailed,
    RequestStarted,
    SchedulerOutputs,
    StepOutput,
)
from baton.scheduler_stats import AggregateStats, merge_replica_stats

logger = logging.getLogger(__name__)

ReplyItem = GenerateDelta | ErrorReply | StatsReply | TokenizeReply


@dataclass(slots=True)
class _RequestState:
    """What the detokenizer keeps for one started request."""

    client_id: bytes
    request_id: str
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    # The prompt's last few tokens, or all of them when its tokens' logprobs are asked for.
    prompt_tail: list[int]
    completion_tokens: int = 0
    cached_tokens: int = 0  # from the scheduler's first output of the request
    # The last few generated tokens: the context each logprob token's text is decoded in.
    logprob_context: list[int] = field(default_factory=list)
    # A stop string matched: the client has its final delta, or with `return_stats` the delta
    # waits in `held` for the stats of the scheduler's own final output (which deletes this
    # state), the only output still to come.
    stopped: bool = False
    return_stats: bool = False
    held: GenerateDelta | None = None


class Handled(NamedTuple):
    """What one message produced: replies per client (in order) and messages for the scheduler."""

    replies: dict[bytes, list[ReplyItem]]
    to_scheduler: list[AbortRid]


class DetokenizerService:
    """The socket-free core: per-request detokenizer state and message -> replies translation."""

    def __init__(self, tokenizer: Tokenizer, replicas: int = 1) -> None:
        """`replicas`: data-parallel replicas, each of which answers every stats request (their
        answers are merged into one reply)."""
        self._tokenizer = tokenizer
        self._logprob_texts = LogprobTexts(tokenizer)
        self._requests: dict[str, _RequestState] = {}
        self._replicas = replicas
        self._stats_parts: dict[tuple[bytes, str], list[AggregateStats]] = {}

    @property
    def active_rids(self) -> set[str]:
        """The rids whose state is still held (stopped ones included)."""
        return set(self._requests)

    def handle_message(self, message: DetokenizerMessage) -> Handled:
        """Apply one message from the scheduler or tokenizer; Shutdown produces nothing."""
        handled = Handled({}, [])
        if isinstance(message, SchedulerOutputs):
            for started in message.started:
                self._register(started, handled)
            for step in message.steps:
                self._apply_step(step, handled)
        elif isinstance(message, RequestFailed):
            error = ErrorReply(
                request_id=message.request_id, code=message.code, message=message.message
            )
            _add_reply(handled, message.client_id, error)
        elif isinstance(message, ForwardedStats):
            key = (message.client_id, message.request_id)
            parts = self._stats_parts.setdefault(key, [])
            parts.append(message.stats)
            if len(parts) == self._replicas:
                del self._stats_parts[key]
                stats = merge_replica_stats(parts) if len(parts) > 1 else parts[0]
                reply = StatsReply(request_id=message.request_id, stats=stats)
                _add_reply(handled, message.client_id, reply)
        elif isinstance(message, ForwardedTokenizeReply):
            _add_reply(handled, message.client_id, message.reply)
        return handled

    def generating_rids(self, client_id: bytes) -> list[str]:
        """The rids of a client's requests the scheduler still generates for (a stopped one is
        being aborted already)."""
        return [
            rid
            for rid, state in self._requests.items()
            if state.client_id == client_id and not state.stopped
        ]

    def client_vanished(self, client_id: bytes) -> list[AbortRid]:
        """Forget a client's requests; the aborts the scheduler needs for those still running."""
        aborts = [AbortRid(rid=rid) for rid in self.generating_rids(client_id)]
        rids = [rid for rid, state in self._requests.items() if state.client_id == client_id]
        for rid in rids:
            del self._requests[rid]
        return aborts

    def _register(self, started: RequestStarted, handled: Handled) -> None:
        if started.rid in self._requests:
            logger.warning("request %s registered twice; replacing its state", started.rid)
        try:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer,
                started.prompt_tail,
                started.stop,
                started.skip_special_tokens,
                started.min_tokens,
                started.include_stop_str_in_output,
            )
        except Exception as error:  # tokenizers raise various types for out-of-range ids
            logger.warning("cannot detokenize request %s: %s", started.rid, error)
            self._requests.pop(started.rid, None)
            message = f"cannot decode the prompt: {error}"
            _add_reply(handled, started.client_id, _internal_error(started.request_id, message))
            handled.to_scheduler.append(AbortRid(rid=started.rid))
            return
        self._requests[started.rid] = _RequestState(
            client_id=started.client_id,
            request_id=started.request_id,
            detokenizer=detokenizer,
            prompt_tokens=started.prompt_tokens,
            prompt_tail=started.prompt_tail,
            return_stats=started.return_stats,
        )
        admitted = GenerateDelta(
            request_id=started.request_id,
            token_ids=[],
            text="",
            admission=True,
            in_reasoning=started.in_reasoning,
        )
        _add_reply(handled, started.client_id, admitted)

    def _apply_step(self, step: StepOutput, handled: Handled) -> None:
        state = self._requests.get(step.rid)
        if state is None:
            return  # never registered, failed, or its client vanished
        if state.stopped:
            if step.finished:
                del self._requests[step.rid]
                if state.held is not None:
                    state.held.stats = step.stats
                    _add_reply(handled, state.client_id, state.held)
            return
        try:
            delta = self._delta(state, step)
        except Exception as error:  # a bad token id must not take down every other request
            logger.exception("detokenizing request %s failed", step.rid)
            del self._requests[step.rid]
            message = f"detokenization failed: {error}"
            _add_reply(handled, state.client_id, _internal_error(state.request_id, message))
            if not step.finished:
                handled.to_scheduler.append(AbortRid(rid=step.rid))
            return
        if delta is None:
            return
        if step.finished:
            del self._requests[step.rid]
        elif delta.finished:  # a stop string: the scheduler still generates until it aborts
            state.stopped = True
            handled.to_scheduler.append(AbortRid(rid=step.rid, reason="stop"))
            if state.return_stats:
                state.held = delta
                return
        _add_reply(handled, state.client_id, delta)

    def _delta(self, state: _RequestState, step: StepOutput) -> GenerateDelta | None:
        """The client's delta for one step (None if there is nothing to tell)."""
        pushed = state.detokenizer.push(step.new_token_ids, step.ends_on_stop_token)
        # A stop string may end the output before the step's last token (speculation).
        token_ids = step.new_token_ids[: pushed.num_tokens]
        state.completion_tokens += len(token_ids)
        if step.cached_tokens is not None:
            state.cached_tokens = step.cached_tokens
        text = pushed.text
        stopped_by_string = pushed.stop_string is not None
        if step.finished and not stopped_by_string:
            text += state.detokenizer.flush()
        if not (step.finished or stopped_by_string or token_ids) and step.prompt_logprobs is None:
            return None
        finished = step.finished or stopped_by_string
        logprobs = None
        if step.logprobs is not None:
            logprobs, state.logprob_context = self._logprob_texts.entries(
                state.logprob_context, token_ids, step.logprobs[: len(token_ids)]
            )
        delta = GenerateDelta(
            request_id=state.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finished=finished,
        )
        if step.prompt_logprobs is not None:
            delta.prompt_logprobs = self._logprob_texts.prompt(
                state.prompt_tail, step.prompt_logprobs
            )
        if finished:
            delta.finish_reason = "stop" if stopped_by_string else step.finish_reason
            # A stop string can finish the request before the scheduler's final output (stats).
            cached = step.stats.cached_tokens if step.stats is not None else state.cached_tokens
            delta.usage = Usage(
                prompt_tokens=state.prompt_tokens,
                completion_tokens=state.completion_tokens,
                cached_tokens=cached,
            )
            delta.stats = step.stats
        return delta


def _add_reply(handled: Handled, client_id: bytes, reply: ReplyItem) -> None:
    handled.replies.setdefault(client_id, []).append(reply)


def _internal_error(request_id: str, message: str) -> ErrorReply:
    return ErrorReply(request_id=request_id, code="internal", message=message)
