"""The small value types of a sequence's lifecycle: states, history events, scheduled steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SequenceStatus(enum.Enum):
    """Coarse states (Vajra): WAITING -> RUNNING -> FINISHED; RUNNING -> WAITING_PREEMPT ->
    RUNNING (pages given back, recomputed); RUNNING <-> PAUSED (pages kept, not scheduled)."""

    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    WAITING_PREEMPT = "waiting_preempt"
    FINISHED = "finished"


class EventKind(enum.Enum):
    """Lifecycle transitions recorded in a sequence's append-only history."""

    CREATED = "created"
    PREFIX_MATCHED = "prefix_matched"
    PREFILL_SCHEDULED = "prefill_scheduled"
    PREFILL_APPLIED = "prefill_applied"
    DECODE_SCHEDULED = "decode_scheduled"
    DECODE_APPLIED = "decode_applied"
    SPECULATIVE_SCHEDULED = "speculative_scheduled"
    SPECULATIVE_APPLIED = "speculative_applied"  # num_tokens: the accepted drafts
    UNASSIGNED_DROPPED = "unassigned_dropped"  # num_tokens: the excess pages' token capacity
    SCHEDULE_REVERTED = "schedule_reverted"
    PREFIX_CACHED = "prefix_cached"
    WINDOW_DROPPED = "window_dropped"  # num_tokens: the pages' token capacity
    RELEASED = "released"
    REACQUIRED = "reacquired"
    PAUSED = "paused"
    RESUMED = "resumed"
    DISPLACED = "displaced"  # skipped one step for more urgent work (the token budget)
    FINISHED = "finished"


@dataclass(frozen=True)
class SequenceEvent:
    """One history entry: what happened, how many tokens it concerned, and when."""

    kind: EventKind
    num_tokens: int
    time: float


class DecodeOutcome(enum.Enum):
    """What applying a decode or speculative step did (the seed's outcome of `apply_decode`):
    whether a KV page filled with computed tokens (it can go to the prefix cache now) and
    whether the sequence reached max_tokens."""

    CONTINUE = "continue"
    BLOCK_COMPLETED = "block_completed"
    MAX_LENGTH = "max_length"
    BLOCK_COMPLETED_AND_MAX_LENGTH = "block_completed_and_max_length"

    @classmethod
    def of(cls, block_completed: bool, max_length: bool) -> DecodeOutcome:
        if block_completed:
            return cls.BLOCK_COMPLETED_AND_MAX_LENGTH if max_length else cls.BLOCK_COMPLETED
        return cls.MAX_LENGTH if max_length else cls.CONTINUE

    @property
    def block_completed(self) -> bool:
        return self in (DecodeOutcome.BLOCK_COMPLETED, DecodeOutcome.BLOCK_COMPLETED_AND_MAX_LENGTH)


@dataclass(frozen=True)
class ScheduledStep:
    """What one scheduled step asks of the engine for this sequence.

    A speculative step computes the tail token and `num_drafts` draft tokens (`num_tokens` =
    1 + num_drafts) and yields 1 to 1 + num_drafts tokens: the accepted drafts and one more.
    """

    start: int  # kv_position before the step: tokens already in the cache
    num_tokens: int  # tokens whose K/V the step computes
    samples: bool  # whether the step samples a token (final prefill chunk, or decode)
    is_prefill: bool
    num_pages_allocated: int  # pages this step pre-allocated, released LIFO by a revert
    num_drafts: int = 0


@dataclass
class RequestTimes:
    """Wall-clock timestamps for per-request stats."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
