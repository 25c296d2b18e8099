"""Start-up's memory check (baton/engine/memory_fit.py): a model that does not fit is refused in
one line before any weight is read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.native_cache import use_private_cache

import baton.engine.memory_fit as memory_fit
from baton import LLM
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import Checkpoint, load_checkpoint
from baton.config import ConfigurationError
from baton.engine.memory_fit import (
    RUNTIME_BYTES,
    available_memory_bytes,
    check_fits,
    expected_weight_bytes,
)
from baton.engine.weights.gguf_file import read_gguf_tensors

MIB = 1 << 20
PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted GGUF metadata goes to a cache of the tests' own."""
    use_private_cache(tmp_path_factory, monkeypatch)


@pytest.fixture
def tiny_gguf(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> Path:
    """A tiny Llama as a Q8_0 GGUF (its in_features, 64, 96 and 160, are whole 32-weight
    blocks)."""
    model_dir = tiny_model_factory("llama", **PLAIN_ROPE)
    return export_gguf(model_dir, "float32", tmp_path / "tiny-Q8_0.gguf", "Q8_0")


# --- check_fits ---------------------------------------------------------------------------------


def test_a_model_that_fits_passes() -> None:
    weights, kv = 300 * MIB, 200 * MIB
    check_fits(weights, kv, weights + kv + RUNTIME_BYTES)  # exactly enough
    check_fits(weights, kv, 64 << 30)


@pytest.mark.parametrize(
    ("weights", "kv", "short"),
    [
        (300 * MIB, 200 * MIB, 1),  # a byte short
        (8 << 30, 0, 1 << 30),  # the weights alone are too many
        (0, 4 << 30, 1 << 30),  # the KV pool counts whole
        (0, 0, 1),  # the runtime's share counts too
    ],
)
def test_a_model_that_does_not_fit_is_refused_in_one_line_naming_the_fix(
    weights: int, kv: int, short: int
) -> None:
    available = weights + kv + RUNTIME_BYTES - short
    with pytest.raises(ConfigurationError) as refused:
        check_fits(weights, kv, available)
    message = str(refused.value)
    assert "\n" not in message
    assert "does not fit" in message
    assert "--kv-cache-memory-bytes" in message and "--max-model-len" in message


def test_nothing_is_checked_where_the_available_memory_is_unknown() -> None:
    check_fits(1 << 50, 1 << 50, None)


# --- available_memory_bytes ---------------------------------------------------------------------

MEMINFO = """\
MemTotal:       24684000 kB
MemFree:        18345000 kB
MemAvailable:   {available} kB
Buffers:          123456 kB
Cached:          5000000 kB
"""


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder standing in for /sys/fs/cgroup (empty: no cgroup limit to read), so that the
    machine's own cgroup plays no part."""
    folder = tmp_path / "cgroup"
    folder.mkdir()
    real_path = memory_fit.Path

    def path(name: str | Path) -> Path:
        name = str(name)
        if name.startswith("/sys/fs/cgroup/"):
            return folder / name.removeprefix("/sys/fs/cgroup/")
        return real_path(name)

    monkeypatch.setattr(memory_fit, "Path", path)
    return folder


def test_the_available_memory_is_the_kernels_memavailable(tmp_path: Path, cgroup: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO.format(available=12345678))
    assert available_memory_bytes(meminfo) == 12345678 * 1024
    (cgroup / "memory.max").write_text("max\n")  # a cgroup without a limit
    (cgroup / "memory.current").write_text(f"{5 << 30}\n")
    assert available_memory_bytes(meminfo) == 12345678 * 1024


def test_a_cgroup_limit_below_memavailable_is_what_is_available(
    tmp_path: Path, cgroup: Path
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO.format(available=20 << 20))  # 20 GiB, in kB
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert available_memory_bytes(meminfo) == 5 << 30
    # A limit with more headroom than the machine has: MemAvailable.
    (cgroup / "memory.max").write_text(f"{64 << 30}\n")
    assert available_memory_bytes(meminfo) == 20 << 30


def test_without_meminfo_or_cgroup_the_available_memory_is_unknown(
    tmp_path: Path, cgroup: Path
) -> None:
    missing = tmp_path / "no-meminfo"
    assert available_memory_bytes(missing) is None
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert available_memory_bytes(missing) == 7 << 30  # the cgroup's headroom alone


def test_this_machines_available_memory_is_read() -> None:
    """/proc/meminfo exists on Linux: some memory is available to this running process."""
    available = available_memory_bytes()
    assert available is not None and available > 0


# --- expected_weight_bytes ----------------------------------------------------------------------


def test_a_gguf_held_as_stored_takes_its_file_size(tiny_gguf: Path) -> None:
    checkpoint = load_checkpoint(str(tiny_gguf))
    assert checkpoint.gguf_file is not None
    size = tiny_gguf.stat().st_size
    assert expected_weight_bytes(checkpoint, 4, held_as_stored=True) == size
    # AVX-512 panels and AMX tiles hold its Q8_0 matrices once more each (all of them here: the
    # norms are F32 vectors, not matrices).
    matrices = sum(
        tensor.data.nbytes for tensor in read_gguf_tensors(tiny_gguf) if len(tensor.shape) == 2
    )
    assert 0 < matrices < size
    for copies in (1, 2):
        assert expected_weight_bytes(checkpoint, 4, True, copies) == size + copies * matrices


def test_a_gguf_computed_in_float32_copies_takes_its_matrices_and_its_file(
    tiny_model_factory: Callable[..., Path], tiny_gguf: Path
) -> None:
    """Not held as stored: every matrix in float32, counted from transformers' own model (the
    untied head included), plus the file's blocks the compact kernels keep."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama", **PLAIN_ROPE))
    matrices = sum(p.numel() for p in reference.parameters() if p.dim() == 2)
    checkpoint = load_checkpoint(str(tiny_gguf))
    expected = matrices * 4 + tiny_gguf.stat().st_size
    assert expected_weight_bytes(checkpoint, 4, held_as_stored=False) == expected
    # A plan that reads no stored weights (no native kernels) keeps no copy of the blocks.
    assert expected_weight_bytes(checkpoint, 4, False, stored_copy=False) == matrices * 4


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_mixture_of_experts_counts_every_expert(
    tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """Every expert's matrices (and the routers, the shared expert, the dense layers' MLPs):
    the float32 checkpoint's matrices, counted from transformers' own model."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(variant)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    # (transformers holds the experts stacked in 3-D parameters; norms and biases are 1-D)
    matrices = sum(p.numel() for p in reference.parameters() if p.dim() >= 2)
    checkpoint = load_checkpoint(str(model_dir))
    assert expected_weight_bytes(checkpoint, 4, False, stored_copy=False) == matrices * 4


def test_the_built_in_random_model_takes_no_file_bytes(random_checkpoint: Checkpoint) -> None:
    assert expected_weight_bytes(random_checkpoint, 4, held_as_stored=False) == 0


# --- the engine ---------------------------------------------------------------------------------


def test_the_engine_refuses_a_model_that_does_not_fit_before_loading_weights(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_built: list[object] = []

    def no_model(*args: object, **kwargs: object) -> None:
        models_built.append(args)
        raise AssertionError("the model was built: its weights were to be loaded")

    monkeypatch.setattr("baton.engine.model_setup.available_memory_bytes", lambda: 100 * MIB)
    monkeypatch.setattr("baton.engine.model_setup.CausalLM", no_model)
    with pytest.raises(ConfigurationError, match="does not fit"):
        LLM(str(tiny_gguf), max_model_len=256)
    assert not models_built


def test_the_engine_starts_a_model_that_fits(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same model with plenty available starts: the check refuses only what does not fit."""
    monkeypatch.setattr("baton.engine.model_setup.available_memory_bytes", lambda: 64 << 30)
    llm = LLM(str(tiny_gguf), max_model_len=256, kv_cache_memory_bytes=16 * MIB)
    assert llm.engine.model is not None
