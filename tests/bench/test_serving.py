"""Serving benchmark: exact metrics on hand-made records, workloads, runs against a fake server."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from bench.fake_openai_server import FakeOpenAIServer, FakeServerConfig

from baton.bench import serving
from baton.bench.metrics import RequestRecord, compute_metrics, format_report
from baton.bench.workloads import (
    arrival_offsets,
    build_workload,
    jsonl_requests,
    random_requests,
    sharegpt_synthetic_requests,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STATS = ("mean", "median", "std", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")
# The --output-json schema of one run, written out independently of the code under test.
RESULT_KEYS = {
    "date", "base_url", "endpoint", "model_id", "dataset_name", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "seed", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "tpots",
    "itls", "e2els", "errors", "server_info",
} | {f"{stat}_{metric}_ms" for stat in STATS for metric in METRICS}  # fmt: skip


def parse_args(url: str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_serving_args(parser)
    defaults = ["--base-url", url, "--disable-tqdm", "--dataset-name", "fixed"]
    return parser.parse_args([*defaults, "--random-input-len", "16", *flags])


def run(url: str, *flags: str) -> dict[str, Any]:
    return asyncio.run(serving.run_benchmark(parse_args(url, *flags)))


# --- metrics: a pure function, checked against percentiles worked out by hand ---------------


def hand_made_records() -> list[RequestRecord]:
    return [
        RequestRecord(0.0, 10, [0.1, 0.2, 0.4], end_s=0.4, output_tokens=3, success=True),
        RequestRecord(1.0, 20, [1.3, 1.4], end_s=1.4, output_tokens=2, success=True),
        RequestRecord(0.5, 30, [0.55], end_s=0.55, output_tokens=1, success=True),
        RequestRecord(0.2, 40, error="HTTP 500: boom"),
    ]


def test_metrics_exact_on_hand_made_records() -> None:
    result = compute_metrics(hand_made_records(), duration_s=2.0)
    assert (result["completed"], result["failed"], result["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (60, 6)
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["input_throughput"] == pytest.approx(30.0)
    assert result["output_throughput"] == pytest.approx(3.0)
    assert result["total_token_throughput"] == pytest.approx(33.0)
    # TTFT [100, 300, 50]; ITL [100, 200, 100]; TPOT [(400-100)/2, 100/1]; E2E [400, 400, 50].
    expected = {
        "ttft": (150.0, 100.0, math.sqrt(35000 / 3), 260.0, 296.0),
        "itl": (400 / 3, 100.0, math.sqrt(20000 / 9), 180.0, 198.0),
        "tpot": (125.0, 125.0, 25.0, 145.0, 149.5),
        "e2el": (850 / 3, 400.0, math.sqrt(245000 / 9), 400.0, 400.0),
    }
    for metric, values in expected.items():
        for stat, value in zip(STATS, values):
            assert result[f"{stat}_{metric}_ms"] == pytest.approx(value), (stat, metric)
    assert [pytest.approx(gaps) for gaps in result["itls"]] == [[0.1, 0.2], [0.1], []]


def test_tpot_uses_token_count_not_chunk_count() -> None:
    record = RequestRecord(0.0, 4, [0.1, 0.5], end_s=0.5, output_tokens=5, success=True)
    result = compute_metrics([record], duration_s=1.0)
    assert result["mean_tpot_ms"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1)
    assert result["mean_itl_ms"] == pytest.approx(400.0)


def test_all_failed_reports_zeros() -> None:
    result = compute_metrics([RequestRecord(0.0, 5, error="x")] * 2, duration_s=1.0)
    assert (result["completed"], result["failed"], result["mean_ttft_ms"]) == (0, 2, 0.0)
    assert "Successful requests:" in format_report(result)


# --- workloads -------------------------------------------------------------------------------


def test_random_lengths_within_range_and_ids_within_vocab() -> None:
    requests = random_requests(400, 100, 50, 0.5, seed=1, vocab_size=300, as_text=False)
    inputs = [request.prompt_len for request in requests]
    outputs = [request.output_len for request in requests]
    assert 50 <= min(inputs) < 60 and 140 < max(inputs) <= 150
    assert 25 <= min(outputs) < 30 and 70 < max(outputs) <= 75
    assert all(len(request.prompt) == request.prompt_len for request in requests)
    assert all(0 <= token < 300 for request in requests for token in request.prompt)
    again = random_requests(400, 100, 50, 0.5, seed=1, vocab_size=300, as_text=False)
    other = random_requests(400, 100, 50, 0.5, seed=2, vocab_size=300, as_text=False)
    assert again == requests != other
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, 1.0, seed=0, vocab_size=10, as_text=False)


def test_fixed_lengths_exact_and_text_prompts() -> None:
    requests = build_workload("fixed", 20, 0, 33, 7, range_ratio=0.9, as_text=True)
    assert {(request.prompt_len, request.output_len) for request in requests} == {(33, 7)}
    assert all(len(request.prompt.split()) == 33 for request in requests)


def test_sharegpt_synthetic_statistics() -> None:
    requests = sharegpt_synthetic_requests(2000, seed=0, vocab_size=256, as_text=False)
    inputs = [request.prompt_len for request in requests]
    outputs = [request.output_len for request in requests]
    assert statistics.mean(inputs) == pytest.approx(230, rel=0.15)
    assert statistics.mean(outputs) == pytest.approx(200, rel=0.15)
    # Log-normal: right-skewed, so the median sits well below the mean.
    assert statistics.median(inputs) < 0.8 * statistics.mean(inputs)
    assert min(inputs + outputs) >= 4 and max(inputs + outputs) <= 1024


def test_jsonl_parsing(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    lines = [
        {"prompt": "hello there world", "output_len": 5},
        {"prompt": [1, 2, 3, 4], "output_len": 6},
        {"prompt": "x", "output_len": 7, "prompt_len": 42},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = jsonl_requests(path, 3, seed=0)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        ("hello there world", 3, 5),
        ([1, 2, 3, 4], 4, 6),
        ("x", 42, 7),
    ]
    assert [r.output_len for r in jsonl_requests(path, 5, seed=0)] == [5, 6, 7, 5, 6]
    assert len(jsonl_requests(path, 2, seed=0)) == 2
    path.write_text('{"prompt": "no output length"}\n')
    with pytest.raises(ValueError, match="output_len"):
        jsonl_requests(path, 1, seed=0)


def test_arrival_offsets() -> None:
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 100.0, 1.0, seed=0)
    gaps = [later - earlier for earlier, later in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.01, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.01, rel=0.1)  # exponential: std = mean


# --- against the fake server -----------------------------------------------------------------


def test_timings_match_the_server_schedule() -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01)) as server:
        result = run(server.url, "--num-prompts", "6", "--random-output-len", "8")
        payload = server.payloads[0]
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["model_id"] == "fake-model"  # discovered through GET /v1/models
    assert payload["max_tokens"] == payload["min_tokens"] == 8
    assert payload["ignore_eos"] is True and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    assert len(payload["prompt"]) == 16 and all(isinstance(t, int) for t in payload["prompt"])
    assert 49 <= result["mean_ttft_ms"] <= 90
    assert 8.5 <= result["mean_itl_ms"] <= 14 and 8.5 <= result["median_itl_ms"] <= 14
    assert 8.5 <= result["mean_tpot_ms"] <= 14
    assert 119 <= result["mean_e2el_ms"] <= 170  # 50 + 10 * (8 - 1)
    assert result["total_output_tokens"] == 6 * 8
    assert result["total_input_tokens"] == 6 * 17  # the server's usage counts a BOS
    assert result["duration"] >= max(result["e2els"])
    assert result["output_throughput"] == pytest.approx(48 / result["duration"])
    assert result["request_throughput"] == pytest.approx(6 / result["duration"])


def test_usage_preferred_over_chunk_count_and_fallback() -> None:
    multi_token_chunks = FakeServerConfig(ttft_s=0.01, itl_s=0.002, tokens_per_chunk=2)
    with FakeOpenAIServer(multi_token_chunks) as server:
        result = run(server.url, "--num-prompts", "2", "--random-output-len", "6")
    assert result["output_lens"] == [6, 6]
    assert [len(gaps) for gaps in result["itls"]] == [2, 2]  # 3 chunks per request
    without_usage = FakeServerConfig(ttft_s=0.01, itl_s=0.002, send_usage=False)
    with FakeOpenAIServer(without_usage) as server:
        result = run(server.url, "--num-prompts", "2", "--random-output-len", "5")
    assert result["output_lens"] == [5, 5]
    assert result["input_lens"] == [16, 16]


def test_chat_endpoint_ignores_role_chunk() -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.005)) as server:
        flags = ["--endpoint", "/v1/chat/completions", "--random-output-len", "4"]
        result = run(server.url, *flags, "--num-prompts", "2")
        payload = server.payloads[0]
    assert result["completed"] == 2 and result["output_lens"] == [4, 4]
    assert 49 <= result["mean_ttft_ms"] <= 90  # the empty role delta is not the first token
    assert len(payload["messages"][0]["content"].split()) == 16
    assert payload["max_completion_tokens"] == 4


def test_failures_are_counted_and_the_run_completes() -> None:
    modes = [None, "http500", None, "malformed", None, "disconnect", None, "error_event"]
    config = FakeServerConfig(ttft_s=0.01, itl_s=0.002, failure_modes=[*modes, None, "no_done"])
    with FakeOpenAIServer(config) as server:
        # One at a time, so the server's arrival order (which picks the failure) is known.
        result = run(server.url, "--num-prompts", "10", "--random-output-len", "6",
                     "--max-concurrency", "1")  # fmt: skip
    assert (result["completed"], result["failed"]) == (5, 5)
    errors = result["errors"]
    assert errors[0].startswith("HTTP 500") and "JSONDecodeError" in errors[1]
    assert "ClientPayloadError" in errors[2] and "engine died" in errors[3]
    assert errors[4] == "stream ended without [DONE]"
    assert result["total_output_tokens"] == 5 * 6


def test_server_rejecting_min_tokens_gets_requests_without_it() -> None:
    strict = FakeServerConfig(ttft_s=0.01, itl_s=0.002, rejected_fields=frozenset({"min_tokens"}))
    with FakeOpenAIServer(strict) as server:
        result = run(server.url, "--num-prompts", "3", "--random-output-len", "3",
                     "--max-concurrency", "1")  # fmt: skip
        sent_min_tokens = ["min_tokens" in payload for payload in server.payloads]
    assert (result["completed"], result["failed"], result["output_lens"]) == (3, 0, [3, 3, 3])
    assert sent_min_tokens == [True, False, False, False]  # one rejected try, then never again


def test_other_rejections_fail_and_request_flags_shape_the_body() -> None:
    strict = FakeServerConfig(ttft_s=0.01, itl_s=0.002, rejected_fields=frozenset({"top_k"}))
    with FakeOpenAIServer(strict) as server:
        rejected = run(server.url, "--num-prompts", "2", "--extra-body", '{"top_k": 5}')
        accepted = run(server.url, "--num-prompts", "2", "--random-output-len", "3",
                       "--no-send-min-tokens", "--no-ignore-eos",
                       "--extra-body", '{"temperature": 0.7}')  # fmt: skip
        payload = server.payloads[-1]
    assert rejected["failed"] == 2 and rejected["errors"][0].startswith("HTTP 400")
    assert (accepted["completed"], accepted["failed"]) == (2, 0)
    assert "min_tokens" not in payload and payload["ignore_eos"] is False
    assert payload["temperature"] == 0.7


def test_requests_follow_the_poisson_schedule() -> None:
    expected = arrival_offsets(6, 20.0, 1.0, seed=3)
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.005, itl_s=0.001)) as server:
        result = run(server.url, "--num-prompts", "6", "--random-output-len", "2",
                     "--request-rate", "20", "--seed", "3")  # fmt: skip
        arrivals = server.stats.arrival_times
    observed = [arrival - arrivals[0] for arrival in arrivals]
    assert observed == pytest.approx(expected, abs=0.03)
    assert result["duration"] >= expected[-1] and result["request_rate"] == 20.0


def test_max_concurrency_cap_is_respected() -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.02, itl_s=0.005)) as server:
        result = run(server.url, "--num-prompts", "12", "--random-output-len", "4",
                     "--max-concurrency", "3")  # fmt: skip
        assert server.max_in_flight == 3
    assert result["completed"] == 12 and result["max_concurrency"] == 3


def test_main_writes_stable_json_schema(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "result.json"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002)) as server:
        flags = ["--num-prompts", "3", "--random-output-len", "4", "--output-json", str(out)]
        flags += ["--num-warmups", "2", "--api-key", "secret"]
        assert serving.main(["--base-url", server.url, "--disable-tqdm", *flags]) == 0
        assert len(server.payloads) == 2 + 3  # warm-ups are sent but not counted
        assert set(server.stats.authorizations) == {"Bearer secret"}
    result = json.loads(out.read_text())
    assert set(result) == RESULT_KEYS
    assert result["request_rate"] == "inf" and result["completed"] == 3
    assert result["server_info"] is None  # a server without Baton's GET /server_info
    assert "Mean TTFT (ms):" in capsys.readouterr().out


def test_concurrency_sweep_writes_plots_and_one_result_per_level(tmp_path: Path) -> None:
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002)) as server:
        args = parse_args(server.url, "--num-prompts", "4", "--random-output-len", "4",
                          "--concurrency-sweep", "1,2", "--output-json", str(out),
                          "--plot", str(plots))  # fmt: skip
        assert serving.run_from_args(args) == 0
        assert server.max_in_flight == 2
    sweep = json.loads(out.read_text())
    assert sweep["concurrency_levels"] == [1, 2]
    assert [result["max_concurrency"] for result in sweep["results"]] == [1, 2]
    # Each level its own prompts: none is served from a cache the level before filled.
    assert [result["seed"] for result in sweep["results"]] == [0, 1]
    assert all(set(result) == RESULT_KEYS for result in sweep["results"])
    names = ["latency_cdf.png", "latency_vs_concurrency.png", "throughput_vs_concurrency.png"]
    assert sorted(path.name for path in plots.iterdir()) == names
    for name in names:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
