"""The load's progress: every item handed out in order, and off a terminal a log line at each
quarter of the bytes, for loads large enough to take a while."""

from __future__ import annotations

import logging

import pytest

from baton.engine.weights.load_progress import QUIET_BELOW_BYTES, with_progress


def test_a_large_load_logs_each_quarter_of_its_bytes(caplog: pytest.LogCaptureFixture) -> None:
    total = 4 * QUIET_BELOW_BYTES
    items = [(index, total // 8) for index in range(8)]
    with caplog.at_level(logging.INFO, logger="baton.engine.weights.load_progress"):
        handed_out = list(with_progress(items, total, "loading model.gguf"))
    assert handed_out == list(range(8))
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(": ")[1].split(" %")[0] for line in lines] == ["25", "50", "75"]
    assert all(line.startswith("loading model.gguf: ") for line in lines)
    assert lines[0].endswith("(0.2 of 1.0 GiB)")  # a quarter of 1 GiB, in GiB


def test_a_small_load_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    total = QUIET_BELOW_BYTES // 2
    with caplog.at_level(logging.INFO, logger="baton.engine.weights.load_progress"):
        assert list(with_progress([("a", total)], total, "loading tiny.gguf")) == ["a"]
    assert not caplog.records


def test_one_item_past_several_quarters_logs_each(caplog: pytest.LogCaptureFixture) -> None:
    total = 4 * QUIET_BELOW_BYTES
    items = [("head", total // 10), ("body", total - total // 10)]
    with caplog.at_level(logging.INFO, logger="baton.engine.weights.load_progress"):
        assert list(with_progress(items, total, "loading x")) == ["head", "body"]
    assert len(caplog.records) == 3  # 25, 50 and 75 %, all crossed by the second item
