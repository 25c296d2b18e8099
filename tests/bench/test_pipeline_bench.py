"""The pipeline-overhead micro-benchmark runs end to end and reports per-token figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.bench.pipeline import main


@pytest.mark.slow
def test_pipeline_overhead_benchmark(tmp_path: Path) -> None:
    output = tmp_path / "pipeline.json"
    argv = ["--model", "baton-random", "--output-len", "8", "--repeats", "1"]
    result = main([*argv, "--output-json", str(output)])
    assert json.loads(output.read_text()) == result
    assert result["in_process_ms_per_token"] > 0 and result["zmq_client_ms_per_token"] > 0
    expected = result["zmq_client_ms_per_token"] - result["in_process_ms_per_token"]
    assert result["overhead_ms_per_token"] == pytest.approx(expected)
