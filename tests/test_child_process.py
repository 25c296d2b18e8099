"""What every child process shares: a SIGTERM landing in a finalizer still ends the process; a
failure report reaches the launcher, and nothing else holds up the exit."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest
import zmq

from baton import child_process
from baton.child_process import LauncherMessage, ReadyReporter, deliver_failure_report
from baton.messages import Codec


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


def test_a_failure_report_reaches_a_launcher_that_binds_after_it_was_sent(tmp_path) -> None:
    """The report waits for its peer under the reporter's linger: sent before the launcher's
    socket exists, it arrives once that binds, and the teardown returns once it went out."""
    address = f"ipc://{tmp_path}/launcher"
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # as run_child sets it: only the report lingers
    reporter = ReadyReporter(context, "scheduler", address)
    reporter.failed("the model does not fit")
    with zmq.Context() as launcher_context, launcher_context.socket(zmq.PULL) as launcher:
        launcher.bind(address)
        started = time.monotonic()
        assert deliver_failure_report(context, timeout=5.0)
        assert time.monotonic() - started < 4.0  # once delivered, not after the 5 s timeout
        assert launcher.poll(1000)
        report = Codec(LauncherMessage).decode_or_none(launcher.recv())
    assert (report.name, report.error) == ("scheduler", "the model does not fit")


def test_a_teardown_that_zmq_blocks_is_given_up_after_its_timeout() -> None:
    """zmq's term waits for every socket of the context, one it does not know of included (here
    a socket of a shadow context, as a socket left in use would): the wait is bounded."""
    context = zmq.Context()
    left_open = zmq.Context.shadow(context.underlying).socket(zmq.PUSH)
    started = time.monotonic()
    assert not deliver_failure_report(context, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 5.0  # bounded, where the term waits forever
    left_open.close(linger=0)  # lets the closer thread's term finish
