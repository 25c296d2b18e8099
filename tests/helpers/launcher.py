"""Real `baton launch` processes for tests: start one, find its children, wait for them to die."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from helpers.ports import free_port_pair


def children_of(pid: int) -> dict[int, str]:
    """Direct children of `pid` and their command lines (Linux /proc)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    result = {}
    for child in map(int, text.split()):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        result[child] = cmdline
    return result


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def start_launcher(
    model_dir: Path | str,
    env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    stderr: IO[str] | None = None,
    processes: int = 4,
) -> tuple[subprocess.Popen, dict[int, str]]:
    """A launcher serving `model_dir` (a checkpoint, or a built-in model's name), once ready,
    with its children (`processes`: four, one more for each tensor-parallel rank past the
    first); its HTTP root is `launcher.http_url`."""
    command = [sys.executable, "-m", "baton.launch", "--model", str(model_dir), "--port", "0"]
    if env is None or "BATON_API_KEY" not in env:  # tcp is refused with an API key
        command += ["--zmq-port", str(free_port_pair())]
    launcher = subprocess.Popen(
        [*command, *extra_args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )
    deadline = time.monotonic() + 120
    for line in launcher.stdout:
        if line.startswith("Baton ready"):
            break
        assert time.monotonic() < deadline, "launcher never became ready"
    launcher.http_url = next(launcher.stdout).split(": ", 1)[1].strip()  # type: ignore[attr-defined]
    children = children_of(launcher.pid)
    assert len(children) == processes  # scheduler(s), detokenizer, tokenizer, frontend
    return launcher, children


def child_pid(children: dict[int, str], process: str) -> int:
    (pid,) = [pid for pid, cmd in children.items() if f"baton.{process}" in cmd]
    return pid


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def scheduler_ranks(children: dict[int, str]) -> list[int]:
    """The scheduler ranks' pids, rank 0 first (the launcher starts them in rank order)."""
    return sorted(pid for pid, cmd in children.items() if "baton.scheduler_proc" in cmd)


def stop_by_a_faulty_rank(
    model: Path, flags: tuple[str, ...], fault: str, processes: int, log_file: Path
) -> tuple[float, str]:
    """Serve `model` with `flags` (several ranks, --distributed-timeout-seconds among them),
    then kill -9 (`fault` "killed") or SIGSTOP ("stalled") scheduler rank 1, sending a stalled
    server one request so the ranks meet in a step; the launcher must exit 1. The seconds from
    the fault to its exit and its stderr; asserts no child and no ipc directory is left."""
    with log_file.open("w+") as stderr:
        launcher, children = start_launcher(
            model, extra_args=flags, stderr=stderr, processes=processes
        )
        try:
            rank_1 = scheduler_ranks(children)[1]
            faulted_at = time.monotonic()
            os.kill(rank_1, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            if fault == "stalled":
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(
                        f"{launcher.http_url}/v1/completions",
                        json={"prompt": "Once", "max_tokens": 4},
                        timeout=30,
                    )
            assert launcher.wait(timeout=40) == 1
            stopped_in = time.monotonic() - faulted_at
        finally:
            launcher.kill()
        stderr.seek(0)
        log = stderr.read()
    assert wait_dead(children, timeout=10.0) == []
    assert list(Path(tempfile.gettempdir()).glob(f"baton-{launcher.pid}-*")) == []
    return stopped_in, log
