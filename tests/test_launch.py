"""The launcher supervises its children: a dead child stops the server, signals stop it cleanly."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers.launcher import child_pid, children_of, start_launcher, wait_dead

from baton import launch
from baton.config import BatonConfig
from baton.launch import Server, ServerStartError

SYS_TGKILL_X86_64 = 234


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_killing_the_scheduler_stops_the_server(stories260k_dir: Path) -> None:
    launcher, children = start_launcher(stories260k_dir)
    try:
        scheduler = child_pid(children, "scheduler_proc")
        killed_at = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        assert launcher.wait(timeout=15) != 0
        assert time.monotonic() - killed_at < 10
        assert wait_dead(children) == []
    finally:
        launcher.kill()


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared libraries mapped into `pid` (Linux /proc)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if ".so" in line}


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_only_the_scheduler_loads_torch(stories260k_dir: Path) -> None:
    """The launcher, tokenizer, detokenizer and frontend resolve the model without torch (a
    process that imported it maps libtorch), and the frontend needs no tokenizer at all."""
    launcher, children = start_launcher(stories260k_dir)
    try:
        libraries = {
            cmd.split(" -m ")[-1].strip(): mapped_libraries(pid) for pid, cmd in children.items()
        }
        libraries["launcher"] = mapped_libraries(launcher.pid)
        assert set(libraries) == {
            "baton.scheduler_proc",
            "baton.tokenizer_proc",
            "baton.detokenizer_proc",
            "baton.frontend",
            "launcher",
        }
        with_torch = {
            name for name, libs in libraries.items() if any("libtorch" in lib for lib in libs)
        }
        assert with_torch == {"baton.scheduler_proc"}
        with_tokenizers = {
            name
            for name, libs in libraries.items()
            if any(lib.startswith("tokenizers") for lib in libs)
        }
        assert "baton.frontend" not in with_tokenizers
        assert "baton.tokenizer_proc" in with_tokenizers  # the check sees the library when loaded
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)


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


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and PR_SET_PDEATHSIG")
def test_children_die_with_a_launcher_killed_while_they_start(stories260k_dir: Path) -> None:
    """A child asks to die with its launcher (PR_SET_PDEATHSIG) only after its imports: seconds,
    for the scheduler's torch. A launcher killed before then once left all four serving, with no
    parent, forever; now each sees that its parent is not the launcher and exits."""
    command = [sys.executable, "-m", "baton.launch", "--model", str(stories260k_dir)]
    launcher = subprocess.Popen(
        [*command, "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    children: dict[int, str] = {}
    deadline = time.monotonic() + 30
    while len(children) < 4 and time.monotonic() < deadline:
        children = children_of(launcher.pid)
        time.sleep(0.005)
    launcher.kill()
    launcher.wait()
    assert len(children) == 4, children
    assert wait_dead(list(children), timeout=60.0) == []


def blocked_signals(pid: int, tid: int) -> int:
    """A thread's blocked-signal mask (bit n - 1 for signal n)."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return int(status.split("SigBlk:")[1].split()[0], 16)


def signal_thread(pid: int, tid: int, signum: int) -> None:
    """Send `signum` to one thread of another process (tgkill; x86-64 Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL_X86_64, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="tgkill on x86-64 Linux"
)
def test_a_sigterm_landing_on_another_thread_of_the_idle_scheduler_ends_it(
    stories260k_dir: Path,
) -> None:
    """The launcher's SIGTERM, and PR_SET_PDEATHSIG's, are process-directed: the kernel may hand
    them to any thread that does not block them, in the scheduler its engine thread or OpenMP's.
    Once an idle scheduler then slept in its poll forever, outliving its killed launcher. (The
    tokenizer and detokenizer wait the same bounded way; at rest only their main thread takes
    signals, ZMQ's blocking them all.)"""
    launcher, children = start_launcher(stories260k_dir)
    try:
        pid = child_pid(children, "scheduler_proc")
        # The threads the kernel may pick: not the main one, and not blocking SIGTERM (ZMQ's I/O
        # threads block every signal).
        threads = [
            tid for tid in map(int, os.listdir(f"/proc/{pid}/task")) if tid != pid
            and not blocked_signals(pid, tid) & (1 << (signal.SIGTERM - 1))
        ]  # fmt: skip
        assert threads, "the engine thread takes signals"
        time.sleep(0.5)  # idle: its loop is waiting on its sockets
        signal_thread(pid, threads[-1], signal.SIGTERM)
        assert wait_dead([pid], timeout=5.0) == []
        assert launcher.wait(timeout=15) != 0  # a child died: the launcher stops the server
    finally:
        launcher.kill()


def test_a_max_model_len_past_the_model_is_refused_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once silently capped at the model's positions (4096 for the built-in model)."""
    from baton import launch

    assert launch.main(["--model", "baton-random", "--max-model-len", "9999", "--port", "1"]) == 1
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


STREAMED = {"prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True}


def assert_refused_while_draining(http: httpx.Client) -> None:
    """New requests and /health get 503 "shutting down" with Retry-After while draining."""
    shutting_down = "the server is shutting down"
    deadline = time.monotonic() + 10
    while shutting_down not in (health := http.get("/health")).text:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    refused = http.post("/v1/completions", json={**STREAMED, "stream": False})
    assert refused.status_code == health.status_code == 503
    assert refused.headers["Retry-After"] == health.headers["Retry-After"] == "1"
    assert refused.json()["error"]["message"] == shutting_down


def sigterm_during_a_stream(
    model_dir: Path,
    tmp_path: Path,
    extra_args: tuple[str, ...] = (),
    while_draining: Callable[[httpx.Client], None] | None = None,
) -> list[str]:
    """Open a stream, pause the detokenizer once its first chunk is in (so the request is
    certainly still open), SIGTERM the launcher, run `while_draining`, and return the stream's
    remaining lines. Without `while_draining`, the lines are read while the detokenizer is
    still paused: only the drain's cut can end them. Asserts the server then exits 0, leaves
    no child behind and logs no traceback."""
    with (tmp_path / "stderr").open("w+") as stderr:
        launcher, children = start_launcher(model_dir, extra_args=extra_args, stderr=stderr)
        detokenizer = child_pid(children, "detokenizer_proc")
        try:
            with (
                httpx.Client(base_url=launcher.http_url, timeout=30) as http,
                http.stream("POST", "/v1/completions", json=STREAMED) as response,
            ):
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(detokenizer, signal.SIGSTOP)
                launcher.send_signal(signal.SIGTERM)
                if while_draining is not None:
                    while_draining(http)
                    os.kill(detokenizer, signal.SIGCONT)
                rest = [line for line in lines if line]
            assert launcher.wait(timeout=30) == 0
            assert wait_dead(children) == []
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(detokenizer, signal.SIGCONT)
            launcher.kill()
        stderr.seek(0)
        assert "Traceback" not in stderr.read()
    return rest


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_lets_an_open_stream_finish_and_refuses_new_requests(
    stories260k_dir: Path, tmp_path: Path
) -> None:
    """vLLM's --shutdown-timeout drain (default 10 s)."""
    rest = sigterm_during_a_stream(
        stories260k_dir, tmp_path, while_draining=assert_refused_while_draining
    )
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_stream_still_open_after_the_shutdown_timeout_ends_with_an_error_and_done(
    stories260k_dir: Path, tmp_path: Path
) -> None:
    rest = sigterm_during_a_stream(stories260k_dir, tmp_path, ("--shutdown-timeout", "0.5"))
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable"
    assert error["message"] == "the server is shutting down"


def test_a_kv_cache_smaller_than_one_request_is_refused_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from baton import launch

    argv = [
        "--model",
        "baton-random",
        "--num-gpu-blocks-override",
        "2",
        "--max-model-len",
        "512",
        "--port",
        "0",
    ]
    assert launch.main(argv) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (
        "scheduler failed to start: the KV cache holds 32 tokens (2 pages of 16), less than one "
        "request of max_model_len 512: give --num-gpu-blocks-override at least 32, or "
        "--max-model-len 32 or less"
    )


def test_a_reasoning_parser_the_model_cannot_mark_is_refused_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from baton import launch

    argv = ["--model", "baton-random", "--reasoning-parser", "qwen3", "--port", "0"]
    assert launch.main(argv) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (
        "tokenizer failed to start: --reasoning-parser qwen3 needs <think> as one token of the "
        "model's vocabulary, and this model has none: drop --reasoning-parser"
    )


def test_an_unreadable_checkpoint_is_refused_in_one_line(
    stories260k_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the scheduler reads the weights: its CheckpointError once came as tracebacks."""
    from baton import launch

    model = tmp_path / "truncated"
    shutil.copytree(stories260k_dir, model)
    with open(model / "model.safetensors", "r+b") as weights:
        weights.truncate(1000)
    assert launch.main(["--model", str(model), "--port", "0"]) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (
        f"scheduler failed to start: {model / 'model.safetensors'}: unreadable safetensors: "
        "Error while deserializing header: invalid header length"
    )


def test_a_port_in_use_is_refused_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    from baton import launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert launch.main(["--model", "baton-random", "--port", str(port)]) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (
        f"frontend failed to start: the HTTP server could not start on 127.0.0.1:{port} "
        "(uvicorn's error is above)"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_during_start_up_stops_at_once(stories260k_dir: Path) -> None:
    """The children run in sessions of their own, so a terminal's Ctrl-C reaches only the
    launcher: it must stop start-up itself, not wait for readiness first."""
    command = [sys.executable, "-m", "baton.launch", "--model", str(stories260k_dir)]
    launcher = subprocess.Popen([*command, "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (
            len(Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()) < 4
        ):
            assert time.monotonic() < deadline, "the children never started"
            time.sleep(0.05)
        children = children_of(launcher.pid)
        launcher.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        assert launcher.wait(timeout=30) == 0
        assert time.monotonic() - stopped_at < 10
        assert "Baton ready" not in launcher.stdout.read()
        assert wait_dead(children) == []
    finally:
        launcher.kill()


@pytest.mark.parametrize(
    ("returncode", "said"),
    [(-9, "was killed by SIGKILL"), (-40, "was killed by signal 40"), (3, "exited with status 3")],
)
def test_how_a_child_ended_is_said_for_every_signal(returncode: int, said: str) -> None:
    """A real-time signal has no name: the launcher still says which (it raised ValueError)."""
    server = SimpleNamespace(processes={"scheduler": SimpleNamespace(returncode=returncode)})
    assert Server.how_it_ended(server, "scheduler") == said  # type: ignore[arg-type]


class _KilledChild:
    """A child process the kernel has killed already (what `start_child` would have started)."""

    pid = 0

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


@pytest.mark.parametrize(("returncode", "memory_hint"), [(-9, True), (-15, False), (1, False)])
def test_a_child_killed_at_start_up_is_named_with_its_likely_cause(
    monkeypatch: pytest.MonkeyPatch, returncode: int, memory_hint: bool
) -> None:
    """A SIGKILL during start-up comes from the kernel's OOM killer: the one line says so (it
    said only that the process exited during start-up)."""
    monkeypatch.setattr(launch, "start_child", lambda *args: _KilledChild(returncode))
    server = Server(BatonConfig(port=0))
    try:
        with pytest.raises(ServerStartError) as error:
            server.start(timeout=5)
    finally:
        server.stop(grace=0.1)
    assert ("most likely out of memory" in str(error.value)) == memory_hint
    assert "during startup" in str(error.value) and "\n" not in str(error.value)
