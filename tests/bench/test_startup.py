"""The start-up benchmark launches a real server and reports its time to healthy and memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from baton.bench.startup import main

PROCESSES = {
    "launcher",
    "baton.scheduler_proc",
    "baton.tokenizer_proc",
    "baton.detokenizer_proc",
    "baton.frontend",
}


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_startup_benchmark_reports_every_process(tmp_path: Path) -> None:
    output = tmp_path / "startup.json"
    result = main(["--model", "baton-random", "--output-json", str(output)])
    assert json.loads(output.read_text()) == result
    assert result["launch_args"] == ["--model", "baton-random"]
    assert 0 < result["healthy_s"] < 600
    assert set(result["resident_mb"]) == PROCESSES
    # Only the scheduler holds torch: each other process is a small fraction of it.
    memory = result["resident_mb"]
    assert all(
        memory[name] < memory["baton.scheduler_proc"] / 2
        for name in PROCESSES - {"baton.scheduler_proc"}
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_server_that_refuses_its_flags_ends_the_benchmark_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """baton launch exits at once (its own line says why); the benchmark says so in one line
    and exits 1, not with a traceback from stopping a server that is gone."""
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "baton-random", "--max-model-len", "0"])
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m baton.bench.startup: baton launch exited with 1"
    )
