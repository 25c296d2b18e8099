"""Typed errors of the sequence protocol (schedulable-sequence seed); request admission's are
baton/validation.py's."""

from __future__ import annotations


class ScheduleError(Exception):
    """A `schedule_*` call whose preconditions do not hold; nothing was changed."""


class NotIdle(ScheduleError):
    """`schedule_*` while as many steps are in flight as the sequence allows."""


class PrefillNotComplete(ScheduleError):
    """Decode scheduled before the whole prefill is scheduled."""


class PrefillComplete(ScheduleError):
    """`schedule_prefill` after every input token is scheduled."""


class PrefillOverrun(ScheduleError):
    """A prefill chunk that would run past the input tokens."""


class AllocationFailed(ScheduleError):
    """Not enough free (or evictable) KV pages for the step."""


class GenerationComplete(ScheduleError):
    """The sequence already has (or will have, counting in-flight steps) `max_tokens` outputs."""


class WrongDanglingCount(ScheduleError):
    """Decode needs exactly one tail token (generated, KV not yet computed)."""


class NothingScheduled(ScheduleError):
    """`revert_schedule` with no scheduled step to undo."""


class ApplyError(Exception):
    """An `apply_*` (or `release`) call that does not match what was scheduled."""


class WrongState(ApplyError):
    """`apply_*` of a kind other than the oldest scheduled step, or with nothing scheduled."""


class TokenOnNonFinalChunk(ApplyError):
    """A sampled token given for a prefill chunk that does not finish the prefill."""


class MissingTokenOnFinalChunk(ApplyError):
    """No sampled token given for the chunk that finishes the prefill."""


class AcceptedExceedsScheduled(ApplyError):
    """A speculative step applied with more accepted drafts than it scheduled."""
