"""Speculative decoding benchmark: flags, the code-edit workload, /metrics counters, the table,
one cell against the fake server, and (slow) a tiny real run on the random model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from bench.fake_openai_server import FakeOpenAIServer, FakeServerConfig

import baton
from baton.bench import serving, speculative
from baton.bench.speculative import DEFAULT_SPECULATIVE_CONFIG, build_parser, server_command
from baton.bench.speculative_report import (
    Cell,
    acceptance,
    counter_delta,
    format_table,
    parse_spec_counters,
    summarize_cells,
    target_line,
)
from baton.bench.workloads import (
    CHAT_ENDPOINT,
    RequestOptions,
    build_payload,
    code_edit_requests,
)
from baton.config_cli import add_config_args, config_from_args
from baton.speculative_config import SpeculativeConfig

BATON_DIR = Path(baton.__file__).resolve().parent


# --- flags -----------------------------------------------------------------------------------


def test_defaults() -> None:
    args = build_parser().parse_args([])
    assert args.model is None  # Baton's own default model
    assert args.speculative_config == DEFAULT_SPECULATIVE_CONFIG
    assert SpeculativeConfig.from_json(args.speculative_config) == SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2
    )
    assert args.max_concurrency == [1, 16] and args.workloads == ["repetitive", "random"]
    assert (args.output_len, args.num_prompts, args.server_args) == (128, 4, "")


def test_flags_parsed_and_checked(capsys: pytest.CaptureFixture) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(
        [
            "--model", "baton-random", "--speculative-config", config,
            "--max-concurrency", "1,4,16", "--workloads", "random", "--num-prompts", "3",
            "--output-len", "32", "--server-args=--max-num-seqs 16", "--output-json", "r.json",
        ]
    )  # fmt: skip
    assert (args.model, args.speculative_config) == ("baton-random", config)
    assert (args.max_concurrency, args.workloads) == ([1, 4, 16], ["random"])
    assert (args.num_prompts, args.output_len, args.output_json) == (3, 32, Path("r.json"))
    assert args.server_args == "--max-num-seqs 16"
    for bad in (
        ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
        ["--speculative-config", "not json"],
        ["--max-concurrency", "0,4"],
        ["--workloads", "repetitive,sharegpt"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    assert "medusa" in capsys.readouterr().err


def test_server_commands_are_understood_by_batons_own_parser() -> None:
    def parsed(argv: list[str]) -> Any:
        parser = argparse.ArgumentParser()
        add_config_args(parser)
        return config_from_args(parser.parse_args(argv))

    off = server_command(None, 8123, ["--max-num-seqs", "16"], None)
    on = server_command("baton-random", 8124, [], DEFAULT_SPECULATIVE_CONFIG)
    assert off.argv[:3] == on.argv[:3] == [sys.executable, "-m", "baton.launch"]
    assert "--model" not in off.argv and "--speculative-config" not in off.argv
    plain, spec = parsed(off.argv[3:]), parsed(on.argv[3:])
    assert (plain.port, plain.host, plain.max_running_requests) == (8123, "127.0.0.1", 16)
    assert plain.speculative_config is None
    assert spec.model == "baton-random"
    assert spec.speculative_config == SpeculativeConfig.from_json(DEFAULT_SPECULATIVE_CONFIG)


# --- the code-edit workload ------------------------------------------------------------------


def test_code_edit_requests_quote_real_code_and_are_seeded() -> None:
    requests = code_edit_requests(6, seed=3, output_len=64)
    assert requests == code_edit_requests(6, seed=3, output_len=64)
    assert requests != code_edit_requests(6, seed=4, output_len=64)
    sources = "\n".join(path.read_text() for path in BATON_DIR.rglob("*.py"))
    for request in requests:
        prompt = request.prompt
        assert isinstance(prompt, str) and request.output_len == 64
        instruction, code = prompt.split("```python\n", 1)
        code = code.removesuffix("\n```")
        assert code in sources and len(code.splitlines()) <= 40  # a window of Baton's own code
        old = instruction.split("`")[1]
        assert f"`{old}` to `{old}_new`" in instruction and code.count(old) >= 1
        assert request.prompt_len == len(prompt) // 4
    payload = build_payload(requests[0], "m", RequestOptions(CHAT_ENDPOINT))
    assert payload["messages"] == [{"role": "user", "content": requests[0].prompt}]


def test_code_edit_requests_from_a_folder(tmp_path: Path) -> None:
    # Keywords, builtins, self and None are never renamed: `offset` is the only candidate.
    lines = [f"return self.offset if isinstance(None, int) else {i}" for i in range(12)]
    (tmp_path / "long.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "short.py").write_text("x = 1\n")  # fewer lines than a window: never chosen
    requests = code_edit_requests(4, seed=0, output_len=8, window_lines=10, source_dir=tmp_path)
    for request in requests:
        assert "renaming `offset` to `offset_new`" in request.prompt
        assert request.prompt.count("return self.offset") == 10 and "x = 1" not in request.prompt
    with pytest.raises(ValueError, match=r"no \.py file"):
        code_edit_requests(1, seed=0, output_len=8, window_lines=50, source_dir=tmp_path)


def test_cell_flags_drive_the_serving_client(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--num-prompts", "3", "--output-len", "20", "--seed", "5"])
    code = speculative.serving_args(args, Cell("repetitive", 16, 1), "http://x", tmp_path)
    assert (code.endpoint, code.base_url, code.max_concurrency) == (CHAT_ENDPOINT, "http://x", 16)
    assert (code.num_prompts, code.seed) == (16, 6)  # at least the concurrency; seed + index
    assert code.temperature == 0.0 and code.ignore_eos and code.send_min_tokens
    assert serving.workload_from_args(code) == code_edit_requests(16, 6, 20)
    words = speculative.serving_args(args, Cell("random", 1, 0), "http://x", tmp_path)
    assert (words.num_prompts, words.seed, words.random_output_len) == (3, 5, 20)
    requests = serving.workload_from_args(words)
    assert all(len(request.prompt.split()) == 128 for request in requests)


# --- /metrics counters -----------------------------------------------------------------------

EXPOSITION = """\
# HELP baton:spec_decode_num_drafts_total Speculative steps.
# TYPE baton:spec_decode_num_drafts_total counter
baton:spec_decode_num_drafts_total{model_name="SmolLM2-135M-Instruct"} 30.0
baton:spec_decode_num_drafts_created 1.7e+09
baton:spec_decode_num_draft_tokens_total{model_name="SmolLM2-135M-Instruct"} 1.2e+02
baton:spec_decode_num_accepted_tokens_total{model_name="a"} 50.0
baton:spec_decode_num_accepted_tokens_total{model_name="b"} 4.0
baton:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 999.0
"""


def test_counters_parsed_from_the_exposition_text() -> None:
    counters = parse_spec_counters(EXPOSITION)
    assert counters == {"drafts": 30.0, "draft_tokens": 120.0, "accepted_tokens": 54.0}
    assert parse_spec_counters("# no speculation here\n") == dict.fromkeys(counters, 0.0)
    after = {"drafts": 40.0, "draft_tokens": 160.0, "accepted_tokens": 84.0}
    assert counter_delta(counters, after) == {
        "drafts": 10.0,
        "draft_tokens": 40.0,
        "accepted_tokens": 30.0,
    }


def test_acceptance_arithmetic() -> None:
    result = acceptance({"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 30.0})
    assert result == {"acceptance_rate": 0.75, "accepted_per_step": 3.0}
    nothing = acceptance({"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0})
    assert nothing == {"acceptance_rate": None, "accepted_per_step": None}


# --- the report ------------------------------------------------------------------------------


def fake_result(throughput: float, tpot: float, ttft: float, **counters: float) -> dict[str, Any]:
    spec = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, **counters}
    return {
        "output_throughput": throughput, "median_tpot_ms": tpot, "median_ttft_ms": ttft,
        "completed": 4, "failed": 0, "spec_counters": spec, "ttfts": [0.1],
    }  # fmt: skip


def test_cells_summarised_with_speedup_and_acceptance() -> None:
    cells = [Cell("repetitive", 1, 0), Cell("random", 16, 1)]
    off = [fake_result(20.0, 50.0, 300.0), fake_result(80.0, 150.0, 2000.0)]
    on = [
        fake_result(36.0, 27.0, 310.0, drafts=100.0, draft_tokens=400.0, accepted_tokens=300.0),
        fake_result(72.0, 170.0, 2100.0, drafts=50.0, draft_tokens=200.0, accepted_tokens=20.0),
    ]
    rows = summarize_cells(cells, off, on)
    code, words = rows
    assert (code["workload"], code["max_concurrency"]) == ("repetitive", 1)
    assert code["speedup"] == pytest.approx(1.8) and words["speedup"] == pytest.approx(0.9)
    assert code["acceptance_rate"] == 0.75 and code["accepted_per_step"] == 3.0
    assert words["acceptance_rate"] == 0.1 and words["accepted_per_step"] == 0.4
    assert code["off"] == {
        "output_throughput": 20.0, "median_tpot_ms": 50.0, "median_ttft_ms": 300.0,
        "completed": 4, "failed": 0,
    }  # fmt: skip
    assert code["spec_counters"]["accepted_tokens"] == 300.0
    table = format_table(rows).splitlines()
    assert table[0].startswith("| workload | concurrency | tok/s off | tok/s on | speed-up")
    assert table[2] == (
        "| repetitive | 1 | 20.0 | 36.0 | 1.80x | 50.0 | 27.0 | 300.0 | 310.0 | 75% | 3.00 |"
    )
    assert table[3] == (
        "| random | 16 | 80.0 | 72.0 | 0.90x | 150.0 | 170.0 | 2000.0 | 2100.0 | 10% | 0.40 |"
    )
    assert target_line(rows) == (
        "Single-stream speed-up on repetitive text: 1.80x (issue 15 expects >= 1.5x: met)"
    )
    assert target_line(rows[1:]) is None
    with pytest.raises(ValueError):
        summarize_cells(cells, off, on[:1])


def test_table_without_drafts_or_throughput() -> None:
    rows = summarize_cells(
        [Cell("repetitive", 1, 0)], [fake_result(0.0, 0, 0)], [fake_result(5, 1, 1)]
    )
    assert rows[0]["speedup"] is None and rows[0]["acceptance_rate"] is None
    assert format_table(rows).splitlines()[2] == (
        "| repetitive | 1 | 0.0 | 5.0 | n/a | 0.0 | 1.0 | 0.0 | 1.0 | n/a | n/a |"
    )
    assert target_line(rows).endswith("not met)")


# --- one cell against the fake server --------------------------------------------------------


def test_a_cell_reports_the_counters_it_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scrapes = iter(
        [
            {"drafts": 5.0, "draft_tokens": 20.0, "accepted_tokens": 10.0},
            {"drafts": 9.0, "draft_tokens": 36.0, "accepted_tokens": 22.0},
        ]
    )
    monkeypatch.setattr(speculative, "fetch_spec_counters", lambda base_url: next(scrapes))
    args = build_parser().parse_args(["--num-prompts", "3", "--output-len", "6"])
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002)) as server:
        bench = speculative.serving_args(args, Cell("repetitive", 2, 0), server.url, tmp_path)
        result = speculative.run_cell(bench)
        payloads = server.payloads
    assert (result["completed"], result["failed"], result["output_lens"]) == (3, 0, [6, 6, 6])
    assert result["spec_counters"] == {"drafts": 4.0, "draft_tokens": 16.0, "accepted_tokens": 12.0}
    assert all("```python" in payload["messages"][0]["content"] for payload in payloads)
    assert all(payload["min_tokens"] == 6 and payload["ignore_eos"] for payload in payloads)
    assert {payload["temperature"] for payload in payloads} == {0.0}


# --- the real thing, tiny --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="stops servers through /proc")
def test_tiny_run_on_the_random_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "spec.json"
    report = speculative.main(
        [
            "--model", "baton-random", "--num-prompts", "2", "--output-len", "8",
            "--max-concurrency", "1,2", "--output-json", str(output),
        ]
    )  # fmt: skip
    assert json.loads(output.read_text()) == json.loads(json.dumps(report, default=str))
    assert [(row["workload"], row["max_concurrency"]) for row in report["cells"]] == [
        ("repetitive", 1), ("repetitive", 2), ("random", 1), ("random", 2),
    ]  # fmt: skip
    for side in ("off", "on"):
        results = report["servers"][side]["results"]
        assert [(r["completed"], r["failed"]) for r in results] == [(2, 0)] * 4
        assert [r["total_output_tokens"] for r in results] == [16] * 4
    off_runs = report["servers"]["off"]["results"]
    assert all(value == 0 for r in off_runs for value in r["spec_counters"].values())
    assert "--speculative-config" in report["servers"]["on"]["command"]
    printed = capsys.readouterr().out
    assert "| repetitive | 1 |" in printed and "Single-stream speed-up" in printed
