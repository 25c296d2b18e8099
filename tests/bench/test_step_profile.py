"""The step profiler runs end to end and reports every piece it promises."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.bench.step_profile import main
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.hardware import isa_rank


def test_profiles_decode_steps_both_ways_and_a_prefill(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    output = tmp_path / "profile.json"
    argv = ["--model", str(model_dir), "--dtype", "float32", "--omp-threads-bind", "nobind"]
    argv += ["--rows", "1,3", "--context", "20", "--prefill-tokens", "48", "--repeats", "1"]
    results = main([*argv, "--output-json", str(output)])
    assert json.loads(output.read_text())["decode"].keys() == {"1", "3"}
    native_kernels = isa_rank(detect_cpu_capabilities().isa) >= isa_rank("avx2") and bool(
        shutil.which("cc")
    )
    for figures in results["decode"].values():
        assert (figures["native_step_ms"] is not None) == native_kernels
        assert figures["eager_step_ms"] > 0 and figures["linear_layers_ms"] > 0
        assert figures["decode_attention_ms"] > 0
    prefill = results["prefill"]
    assert prefill["prefill_ms"] > 0 and prefill["share_of_gemm_rate"] > 0
    assert prefill["prefill_gflops"] > 0 and prefill["linear_layers_gflops"] > 0


@pytest.mark.parametrize("rows", ["0", "x", "1,,2", "-3"])
def test_bad_rows_are_refused_before_any_engine_starts(
    rows: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([f"--rows={rows}"])
    assert "--rows takes positive integers" in capsys.readouterr().err
