"""The `baton` command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.cli import build_parser, main
from baton.config import config_from_args


def test_generate_prints_a_completion(stories260k_dir: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", str(stories260k_dir), "--max-tokens", "300", "The little dog"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "was a little girl named Lily" in captured.out
    assert "finish_reason=stop" in captured.err


def test_generate_with_the_default_model(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--max-tokens", "5", "--ignore-eos", "hi"]) == 0
    assert "[5 tokens, finish_reason=length]" in capsys.readouterr().err


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
