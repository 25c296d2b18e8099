"""The step-overhead micro-benchmark measures both loops consistently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.bench.step_overhead import main


def test_step_overhead_figures_add_up(tmp_path: Path, tiny_llama_dir: Path) -> None:
    output = tmp_path / "steps.json"
    argv = [
        "--model",
        str(tiny_llama_dir),
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--output-json",
        str(output),
    ]
    results = main(argv)
    assert json.loads(output.read_text()) == results
    for figures in results.values():
        # 4 prompts of 6 tokens: at least one prefill step and 5 decode steps.
        assert figures["steps"] >= 6
        assert 0 < figures["forward_ms"] <= figures["step_ms"]
        expected = figures["step_ms"] - figures["forward_ms"]
        assert figures["outside_forward_ms"] == pytest.approx(expected)
        assert figures["output_tokens_per_s"] > 0
