"""The comparison report: summaries, Baton's ratios to each peer, per-level runs, the table."""

from __future__ import annotations

from baton.bench.compare_report import (
    EngineSummary,
    engine_summary,
    format_table,
    level_runs,
    ratios_to_reference,
)


def test_ratios_divide_batons_figures_by_each_peers() -> None:
    summaries = [
        EngineSummary("baton", 200.0, 50.0, 10.0),
        EngineSummary("vllm", 100.0, 25.0, 20.0),
        EngineSummary("transformers", 400.0, None, None),
        EngineSummary("llama.cpp", 0.0, 30.0, 0.0),  # every request failed
    ]
    ratios = ratios_to_reference(summaries, "baton")
    assert ratios == {
        "vllm": {"output_throughput": 2.0, "mean_ttft_ms": 2.0, "mean_tpot_ms": 0.5},
        "transformers": {"output_throughput": 0.5, "mean_ttft_ms": None, "mean_tpot_ms": None},
        "llama.cpp": {"output_throughput": None, "mean_ttft_ms": 50 / 30, "mean_tpot_ms": None},
    }
    assert ratios_to_reference(summaries[1:], "baton") == {}
    lines = format_table(summaries, ratios).splitlines()
    assert len(lines) == 1 + len(summaries) + 1  # header, engines, legend
    vllm_row = lines[2].split()
    assert vllm_row == ["vllm", "100.00", "25.00", "20.00", "2.00x", "2.00x", "0.50x"]
    assert lines[3].split()[:7] == ["transformers", "400.00", "-", "-", "0.50x", "-", "-"]
    assert "no TTFT/TPOT" in lines[3]


def test_engine_summary_of_serving_and_offline_results() -> None:
    serving = {"output_throughput": 12.5, "mean_ttft_ms": 3.0, "mean_tpot_ms": 4.0, "ttfts": []}
    assert engine_summary("vllm", serving) == EngineSummary("vllm", 12.5, 3.0, 4.0)
    offline = {"output_throughput": 7.0, "elapsed_s": 1.0}
    assert engine_summary("transformers", offline) == EngineSummary("transformers", 7.0, None, None)


def test_level_runs_pair_each_levels_results_and_skip_engines_that_did_not_run() -> None:
    def result(throughput: float) -> dict:
        return {"output_throughput": throughput, "mean_ttft_ms": 1.0, "mean_tpot_ms": 2.0}

    records = {
        "baton": {"status": "ok", "results": [result(10.0), result(40.0)]},
        "vllm": {"status": "ok", "results": [result(20.0), result(20.0)]},
        "llama.cpp": {"status": "skipped", "reason": "no --llama-server"},
    }
    runs = level_runs([1, 16], records)
    assert [run["max_concurrency"] for run in runs] == [1, 16]
    assert [set(run["summary"]) for run in runs] == [{"baton", "vllm"}] * 2
    assert [run["ratios"]["vllm"]["output_throughput"] for run in runs] == [0.5, 2.0]
