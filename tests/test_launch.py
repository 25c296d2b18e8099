"""The launcher supervises its children: a dead child stops the server, signals stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port_pair


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
    model_dir: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, dict[int, str]]:
    command = [sys.executable, "-m", "baton.launch", "--model", str(model_dir)]
    if env is None or "BATON_API_KEY" not in env:  # tcp is refused with an API key
        command += ["--zmq-port", str(free_port_pair())]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    for line in launcher.stdout:
        if line.startswith("Baton ready"):
            break
        assert time.monotonic() < deadline, "launcher never became ready"
    children = children_of(launcher.pid)
    assert len(children) == 4  # scheduler, detokenizer, tokenizer, frontend
    return launcher, children


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_killing_the_scheduler_stops_the_server(stories260k_dir: Path) -> None:
    launcher, children = start_launcher(stories260k_dir)
    try:
        (scheduler,) = [pid for pid, cmd in children.items() if "baton.scheduler_proc" in cmd]
        killed_at = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        assert launcher.wait(timeout=15) != 0
        assert time.monotonic() - killed_at < 10
        assert wait_dead(children) == []
    finally:
        launcher.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_stops_everything_cleanly(stories260k_dir: Path) -> None:
    launcher, children = start_launcher(stories260k_dir)
    try:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=15) == 0
        assert wait_dead(children) == []
    finally:
        launcher.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and PR_SET_PDEATHSIG")
def test_children_die_with_a_killed_launcher(stories260k_dir: Path) -> None:
    launcher, children = start_launcher(stories260k_dir)
    launcher.kill()
    launcher.wait()
    assert wait_dead(children) == []


def test_a_max_model_len_past_the_model_is_refused_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once silently capped at the model's positions (4096 for the built-in model)."""
    from baton import launch

    assert launch.main(["--max-model-len", "9999", "--port", "1"]) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert (
        "--max-model-len 9999" in record.getMessage() and "give at most 4096" in record.getMessage()
    )


def test_the_api_key_never_reaches_a_command_line(stories260k_dir: Path) -> None:
    """Every local user can read command lines (`ps`): the key comes from BATON_API_KEY and goes
    to the children on their stdin."""
    secret = "s3cret-key-for-this-test"
    launcher, children = start_launcher(stories260k_dir, {**os.environ, "BATON_API_KEY": secret})
    try:
        assert secret not in Path(f"/proc/{launcher.pid}/cmdline").read_text()
        assert all(secret not in cmdline for cmdline in children.values())
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
