"""Suite-wide fixtures: tiny random HF checkpoints, the stories260K model, the random model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import CORE_VARIANTS, write_tiny_checkpoint

from baton.checkpoint.load import Checkpoint, load_checkpoint
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.engine.cpu.vector_math import initialize_vector_math

REPO_ROOT = Path(__file__).resolve().parents[1]
STORIES260K_DIR = REPO_ROOT / ".." / "shared" / "models" / "stories260K"

TinyModelFactory = Callable[..., Path]


def pytest_configure(config: pytest.Config) -> None:
    """The transformers references compute their RoPE with torch's cos as the engine does, and a
    test may build one before any engine: MKL's vector math set up first
    (engine/cpu/vector_math.py)."""
    initialize_vector_math()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`factory(variant, seed=0, max_shard_size=None, **config_overrides) -> checkpoint dir`.

    Each distinct request is written once per session and shared; treat the folder as read-only.
    """
    cache: dict[str, Path] = {}

    def factory(variant: str, seed: int = 0, **options: Any) -> Path:
        key = repr((variant, seed, sorted(options.items())))
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"tiny_{variant}")
            cache[key] = write_tiny_checkpoint(directory, variant, seed=seed, **options)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: TinyModelFactory) -> Path:
    """Llama: GQA, untied head, attention biases, explicit head_dim, llama3 RoPE scaling."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_factory: TinyModelFactory) -> Path:
    """Qwen2: q/k/v biases, tied embeddings."""
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_factory: TinyModelFactory) -> Path:
    """Qwen3: q/k norms, explicit head_dim."""
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session", params=CORE_VARIANTS)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: TinyModelFactory) -> Path:
    """Each tiny variant in turn (tests using it run once per architecture)."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def stories260k_dir() -> Path:
    """The real tiny trained Llama (stories260K); the test is skipped where it is absent."""
    if not (STORIES260K_DIR / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES260K_DIR}")
    return STORIES260K_DIR.resolve()


@pytest.fixture(scope="session")
def random_checkpoint() -> Checkpoint:
    """The built-in random model (random Llama, byte tokenizer), loaded once."""
    return load_checkpoint(RANDOM_MODEL_NAME)
