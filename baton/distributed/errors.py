"""The error every process may report (child_process.py), kept apart from torch."""


class DistributedError(RuntimeError):
    """The ranks could not join, or a collective failed (a rank died, stalled or timed out)."""
