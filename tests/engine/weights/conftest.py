"""Every test of a checkpoint's weights keeps converted GGUF metadata in a cache of the tests'
own, not the user's (helpers.native_cache)."""

from __future__ import annotations

import pytest
from helpers.native_cache import use_private_cache


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_private_cache(tmp_path_factory, monkeypatch)
