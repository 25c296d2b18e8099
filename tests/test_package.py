"""Importing `baton` sets its environment defaults before torch reads them (OpenMP's wait
policy: passive, so torch's idle threads do not spin on the cores the native decode step needs;
huge pages for torch's large allocations); a user's own value wins, and the server's processes
inherit them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import baton


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [
        ("OMP_WAIT_POLICY", None, "PASSIVE"),
        ("OMP_WAIT_POLICY", "ACTIVE", "ACTIVE"),
        ("THP_MEM_ALLOC_ENABLE", None, "1"),
        ("THP_MEM_ALLOC_ENABLE", "0", "0"),
    ],
)
def test_environment_defaults_unless_told_otherwise(
    name: str, given: str | None, expected: str
) -> None:
    env = {key: value for key, value in os.environ.items() if key != name}
    if given is not None:
        env[name] = given
    probe = (
        f"import baton, os; print(os.environ[{name!r}], {name!r} in baton.DEFAULTED_ENVIRONMENT)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == [expected, str(given is None)]
    assert name in baton.ENVIRONMENT_DEFAULTS
