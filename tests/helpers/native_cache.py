"""The cache (XDG_CACHE_HOME, under pytest's base temp) that tests keep converted GGUF metadata
in, apart from the user's: one for every such test, whose compiled native kernels are the
user's own (they are keyed by their sources, flags and compiler, and safe to share), so that no
test file compiles them again (20 s each time)."""

from __future__ import annotations

import pytest

from baton.engine.native.build import native_cache_root


def use_private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point XDG_CACHE_HOME at the tests' private cache for this test."""
    kernels = native_cache_root()  # (the user's, read before the variable changes)
    private = tmp_path_factory.getbasetemp() / "private-cache"
    linked = private / "baton" / "native"
    if not linked.exists():
        kernels.mkdir(parents=True, exist_ok=True)
        linked.parent.mkdir(parents=True, exist_ok=True)
        linked.symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(private))
