"""Start-up benchmark: how long `baton launch` takes to become healthy, and what each of its
processes holds in memory once it is.

    python -m baton.bench.startup --model ../shared/models/stories260K

Runs `baton launch` with the given flags, polls `GET /health` (a stats round trip through every
pipeline process, the scheduler included) every 50 ms, waits a second, reads each process's
resident memory (VmRSS, Linux), then stops the server with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from baton.bench.output import write_report
from baton.bench.peers import free_port

POLL_S = 0.05
SETTLE_S = 1.0


def resident_mb(pid: int) -> float:
    """A process's resident memory in MiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def process_name(pid: int) -> str:
    """ "launcher", or the module a child runs ("baton.tokenizer_proc")."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    module = command[command.index(b"-m") + 1].decode() if b"-m" in command else ""
    return module if module.startswith("baton.") and module != "baton.cli" else "launcher"


def measure(launch_args: list[str], timeout: float = 600.0) -> dict:
    """Launch a server, time it to healthy, read its processes' memory, stop it."""
    port = free_port()
    command = [sys.executable, "-m", "baton.cli", "launch", *launch_args, "--port", str(port)]
    started = time.monotonic()
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        while not _healthy(port):
            if launcher.poll() is not None:
                raise RuntimeError(f"baton launch exited with {launcher.returncode}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"not healthy after {timeout:.0f} s")
            time.sleep(POLL_S)
        healthy_s = time.monotonic() - started
        time.sleep(SETTLE_S)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        pids = [launcher.pid, *map(int, children.split())]
        memory = {process_name(pid): round(resident_mb(pid), 1) for pid in pids}
    finally:
        if launcher.poll() is None:  # (a launcher that refused its flags has already exited)
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(60)
    return {"launch_args": launch_args, "healthy_s": round(healthy_s, 2), "resident_mb": memory}


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> dict:
    """Entry point of `python -m baton.bench.startup`: any `baton launch` flag is passed on."""
    parser = argparse.ArgumentParser(prog="python -m baton.bench.startup", description=__doc__)
    parser.add_argument("--output-json", default=None)
    args, launch_args = parser.parse_known_args(argv)
    try:
        result = measure(launch_args)
    except RuntimeError as error:  # baton launch logged why; this says what it did, one line
        parser.exit(1, f"{parser.prog}: {error}\n")
    print(f"healthy after {result['healthy_s']:.2f} s")
    for name, megabytes in result["resident_mb"].items():
        print(f"  {name:26s} {megabytes:8.1f} MB resident")
    write_report(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
