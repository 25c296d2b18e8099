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
    SCHEDULE_REVERTED = "schedule_reverted"
    PREFIX_CACHED = "prefix_cached"
    RELEASED = "released"
    REACQUIRED = "reacquired"
    PAUSED = "paused"
    RESUMED = "resumed"
    FINISHED = "finished"


@dataclass(frozen=True)
class SequenceEvent:
    """One history entry: what happened, how many tokens it concerned, and when."""

    kind: EventKind
    num_tokens: int
    time: float


@dataclass(frozen=True)
class ScheduledStep:
    """What one scheduled step asks of the engine for this sequence."""

    start: int  # kv_position before the step: tokens already in the cache
    num_tokens: int  # tokens whose K/V the step computes
    samples: bool  # whether the step samples a token (final prefill chunk, or decode)
    is_prefill: bool
    num_pages_allocated: int  # pages this step pre-allocated, released LIFO by a revert


@dataclass
class RequestTimes:
    """Wall-clock timestamps for per-request stats."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
