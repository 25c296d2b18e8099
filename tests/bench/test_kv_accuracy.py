"""The KV cache dtype accuracy benchmark on stories260K: float32 is its own reference, the
narrower caches cost bytes in proportion and accuracy in order, and the table has every row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.bench.kv_accuracy import main


def test_each_dtype_against_the_float32_cache(
    stories260k_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "kv.json"
    flags = ["--model", str(stories260k_dir), "--tokens", "96", "--chunk", "40"]
    main([*flags, "--kv-cache-dtypes", "float16,fp8", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["dtypes"] == ["float32", "float16", "fp8"]
    assert (report["tokens"], report["chunk"]) == (96, 40)
    float32, float16, fp8 = (report[name] for name in report["dtypes"])
    assert float32["max_abs_logit_diff"] == 0 and float32["argmax_agreement"] == 1
    assert 1 < float32["perplexity"] < 100
    assert [row["kv_bytes_per_token"] for row in (float32, float16, fp8)] == [1280, 640, 320]
    assert 0 < float16["mean_abs_logit_diff"] < fp8["mean_abs_logit_diff"]
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(table) == 5 and table[-1].startswith("| fp8 | 320 |")
