"""Importing `baton` sets OpenMP's wait policy before torch loads OpenMP: passive, so torch's
idle threads do not spin on the cores the native decode step needs; a user's own value wins,
and the server's processes inherit it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import baton, os; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_waits_passively_unless_told_otherwise(given: str | None, expected: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert probe.stdout.strip() == expected
