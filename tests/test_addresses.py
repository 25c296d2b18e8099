"""Server addresses: private directories, and the cleanup of those a killed launcher left."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from baton.addresses import ServerAddresses, remove_stale_directories


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_directory_left_by_a_dead_launcher_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"baton-{dead_pid()}-abc"
    live = tmp_path / f"baton-{os.getpid()}-def"
    unrelated = tmp_path / "baton-notes"
    for directory in (stale, live, unrelated):
        directory.mkdir()
    (stale / "requests").write_text("")
    assert remove_stale_directories(str(tmp_path)) == [stale]
    assert not stale.exists() and live.exists() and unrelated.exists()


def test_addresses_live_in_a_private_directory_named_after_the_launcher() -> None:
    addresses = ServerAddresses.create()
    directory = Path(addresses.directory)
    try:
        assert directory.name.startswith(f"baton-{os.getpid()}-")
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert addresses.requests == f"ipc://{directory}/requests"
    finally:
        directory.rmdir()
