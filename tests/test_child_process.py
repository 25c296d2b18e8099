"""What every child process shares: a SIGTERM landing in a finalizer still ends the process."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest

from baton import child_process


def test_an_exit_swallowed_by_a_finalizer_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """SystemExit raised in a `__del__` reaches the unraisable hook, not the process: the hook
    sends SIGTERM again (from a timer thread) and prints nothing; other errors go to Python's
    own hook."""
    sent: list[tuple[int, int]] = []
    done = threading.Event()

    def fake_kill(pid: int, signum: int) -> None:
        sent.append((pid, signum))
        done.set()

    monkeypatch.setattr(child_process.os, "kill", fake_kill)
    monkeypatch.setattr(sys, "unraisablehook", child_process.exit_outside_finalizers)
    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "__unraisablehook__", lambda args: reported.append(args.exc_value))

    class ExitsWhenCollected:
        def __del__(self) -> None:
            raise SystemExit(0)  # as the SIGTERM handler does, had the signal landed here

    class FailsWhenCollected:
        def __del__(self) -> None:
            raise ValueError("broken finalizer")

    ExitsWhenCollected()
    gc.collect()
    assert done.wait(timeout=5)
    assert sent == [(os.getpid(), signal.SIGTERM)] and reported == []
    FailsWhenCollected()
    gc.collect()
    assert len(reported) == 1 and isinstance(reported[0], ValueError)
