"""Peer engines as servers: their command lines, and a process that is started, probed, stopped.

Each server runs in its own session (process group), so stopping it reaches every process it
spawned (Baton's pipeline processes, vLLM's engine core) and nothing is left behind, and
`PeakRssSampler` sums the memory of all of them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import baton

logger = logging.getLogger(__name__)

# The context each vLLM and llama.cpp server gets: ample for benchmark prompts plus outputs.
PEER_MAX_MODEL_LEN = 4096
# vLLM's CPU backend reserves this many GiB for its KV cache (its default, 4, made explicit).
VLLM_CPU_KVCACHE_GIB = 4
_LLAMA_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclass(frozen=True)
class ServerCommand:
    """How to start one engine's OpenAI-compatible server."""

    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment


def baton_command(
    model: str, port: int, dtype: str, extra_args: list[str] | None = None
) -> ServerCommand:
    """`python -m baton.launch` serving `model` on 127.0.0.1:`port`."""
    argv = [sys.executable, "-m", "baton.launch", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, *(extra_args or [])]
    return ServerCommand("baton", argv)


def vllm_command(python: str, model: str, port: int, dtype: str = "bfloat16") -> ServerCommand:
    """vLLM's OpenAI API server run by the interpreter `python` (one with vllm installed)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    argv += ["--max-model-len", str(PEER_MAX_MODEL_LEN)]
    return ServerCommand("vllm", argv, {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KVCACHE_GIB)})


def llama_server_command(
    server: str, gguf: str, port: int, parallel: int, threads: int
) -> ServerCommand:
    """llama.cpp's `llama-server` with `parallel` slots, each given the full peer context."""
    argv = [server, "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    # -c is shared by all slots, so each slot gets PEER_MAX_MODEL_LEN as vLLM's requests do.
    argv += ["--ctx-size", str(PEER_MAX_MODEL_LEN * parallel), "--parallel", str(parallel)]
    argv += ["--threads", str(threads)]
    return ServerCommand("llama.cpp", argv)


def find_hf_to_gguf_converter(llama_server: Path) -> Path | None:
    """llama.cpp's `convert_hf_to_gguf.py`, looked for beside the server and up to three folders
    above it (a build tree sits inside the llama.cpp checkout that holds the script)."""
    folder = llama_server.resolve().parent
    for candidate in [folder, *list(folder.parents)[:3]]:
        script = candidate / "convert_hf_to_gguf.py"
        if script.is_file():
            return script
    return None


def convert_to_gguf(converter: Path, model: Path, dtype: str, out_dir: Path) -> Path:
    """Write `model` as a GGUF file in `out_dir` (cached there) with llama.cpp's converter,
    which needs the `gguf` package importable here."""
    target = out_dir / f"{model.name}-{_LLAMA_OUTTYPES[dtype]}.gguf"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(converter), str(model), "--outfile", str(target)]
        subprocess.run([*command, "--outtype", _LLAMA_OUTTYPES[dtype]], check=True)
    return target


def gguf_for_llama(llama_server: Path, model: Path, dtype: str, out_dir: Path) -> Path | None:
    """`model` converted to GGUF for llama.cpp, or None without the converter or `gguf`."""
    converter = find_hf_to_gguf_converter(llama_server)
    if converter is None or importlib.util.find_spec("gguf") is None:
        return None
    return convert_to_gguf(converter, model, dtype, out_dir)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time."""


class ServerProcess:
    """One engine server in its own process group, output logged to `log_path`."""

    def __init__(self, command: ServerCommand, port: int, log_path: Path) -> None:
        self.command = command
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log: IO[bytes] | None = None
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """The server's pid, which is also its process group id."""
        return self._process.pid if self._process else None

    def start(self, timeout_s: float) -> None:
        """Start the server and wait until healthy; ServerStartError if it dies or times out."""
        self._log = self.log_path.open("wb")
        inherited = dict(os.environ)
        if self.command.engine != "baton":
            for name in baton.DEFAULTED_ENVIRONMENT:  # Baton's defaults, not the user's
                inherited.pop(name, None)
        env = {**inherited, **self.command.env}
        self._process = subprocess.Popen(
            self.command.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self._process.poll() is not None:
                raise ServerStartError(f"{self.command.engine} exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"{self.command.engine} not healthy after {timeout_s:.0f}s")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        # GET /health where the server has one (Baton, vLLM, llama.cpp), else GET /v1/models.
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(self.base_url + path, timeout=5) as response:
                    return response.status == 200
            except urllib.error.HTTPError as error:
                if error.code != 404:
                    return False
            except OSError:
                return False  # not listening yet
        return False

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The end of the server's output, for error messages."""
        if self._log is not None:
            self._log.flush()
        data = self.log_path.read_bytes() if self.log_path.is_file() else b""
        return data[-num_bytes:].decode("utf-8", errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after `grace_s` seconds."""
        if self._process is not None:
            group = self._process.pid
            _signal_group(group, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while group_members(group) and time.monotonic() < deadline:
                self._process.poll()  # reap the leader, or it stays a zombie in the group
                time.sleep(0.1)
            _signal_group(group, signal.SIGKILL)
            self._process.wait()
            deadline = time.monotonic() + grace_s
            while group_members(group) and time.monotonic() < deadline:
                time.sleep(0.05)  # SIGKILLed members other than the leader take a moment to die
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(group: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)


def group_members(group: int) -> list[int]:
    """Live (non-zombie) processes of process group `group`, read from /proc on Linux."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return []
        return [group]
    table = _process_table()
    return [pid for pid, (state, _, pgrp) in table.items() if pgrp == group and state != "Z"]


def _process_table() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, ppid, pgrp)} of every process, read from /proc (empty off Linux)."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited while we looked
            # Fields after the parenthesised command name: state, ppid, pgrp, ...
            state, ppid, pgrp = stat.rpartition(")")[2].split()[:3]
            table[int(entry.name)] = (state, int(ppid), int(pgrp))
    return table


def process_tree(root: int) -> list[int]:
    """Live (non-zombie) processes of `root`'s tree: its process group (`root` leads one, as a
    server does), plus any descendant of `root` that left the group (a child that called
    setsid). Linux /proc; empty elsewhere."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    descendants, pending = {root}, [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in descendants:
                descendants.add(child)
                pending.append(child)
    group = {pid for pid, (_, _, pgrp) in table.items() if pgrp == root}
    return sorted(pid for pid in group | descendants if pid in table and table[pid][0] != "Z")


def rss_bytes(pid: int) -> int:
    """Process `pid`'s resident set size (VmRSS in /proc/<pid>/status); 0 once it is gone (or
    for a zombie or kernel thread, which has none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # in kB
    return 0


def tree_rss_bytes(root: int) -> int:
    """The summed RSS of every process of `root`'s tree (pages shared between them, such as a
    forked child's copy-on-write pages, count once per process, as in `ps`)."""
    return sum(rss_bytes(pid) for pid in process_tree(root))


class PeakRssSampler:
    """The peak summed RSS of process `root`'s tree (see `tree_rss_bytes`), sampled once on
    `start`, every `interval_s` seconds from a background thread, and once more on `stop`.

        with PeakRssSampler(server.pid) as memory:
            ...  # measure
        memory.peak_mib
    """

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.num_samples = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_mib(self) -> float | None:
        """The peak in MiB (one decimal), or None when no sample found a process (off Linux)."""
        return round(self.peak_bytes / 2**20, 1) if self.peak_bytes else None

    def sample(self) -> int:
        """Take one sample now; returns it (bytes) and raises the peak to it."""
        total = tree_rss_bytes(self.root)
        self.peak_bytes = max(self.peak_bytes, total)
        self.num_samples += 1
        return total

    def start(self) -> None:
        """Sample now, then every `interval_s` seconds until `stop`."""
        self._stopped.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        if self._thread is not None:
            self._stopped.set()
            self._thread.join()
            self._thread = None
            self.sample()

    def __enter__(self) -> PeakRssSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
