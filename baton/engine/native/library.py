"""Builds and loads Baton's native CPU kernel, once per machine, with the C compiler present.

The source (`compact_gemv.c`, plain C with AVX2 intrinsics and OpenMP) compiles in about a
second into `$XDG_CACHE_HOME/baton/native/<hash>/`, keyed by the source, the flags and the
compiler's version, and loads with ctypes: no torch headers, no build step at install. Where it
cannot be built (no compiler, no AVX2) the caller gets None and a one-line reason, and the
engine computes without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from baton.engine.compact_weights import FORMATS, CompactWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("compact_gemv.c")
LIBRARY_NAME = "libbaton_compact_gemv.so"
# -fopenmp links libgomp by soname: loaded after torch, the library shares torch's OpenMP runtime
# (one thread team, sized by torch.set_num_threads on the calling thread).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded here; the message says why, in one line."""


def native_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "baton" / "native"


class CompactGemv:
    """`y = x @ W^T (+ bias)` for float32 x of a few rows and a `CompactWeight` W."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemv = library.baton_compact_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [
            ctypes.c_int,  # format
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # rows of x
            ctypes.c_int64,  # in_features
            ctypes.c_void_p,  # weight bytes
            ctypes.c_int64,  # out_features
            ctypes.c_int64,  # bytes per weight row
            ctypes.c_void_p,  # bias or NULL
            ctypes.c_void_p,  # y
        ]

    def __call__(
        self, x: torch.Tensor, weight: CompactWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: float32 [rows, in_features] -> float32 [rows, out_features]."""
        x = x.contiguous()
        rows, out_features = x.shape[0], weight.out_features
        y = torch.empty(rows, out_features, dtype=torch.float32)
        data = weight.data
        # ctypes releases the GIL for the call: the scheduler thread runs meanwhile.
        self._gemv(
            FORMATS[weight.format].kernel_id,
            x.data_ptr(),
            rows,
            weight.in_features,
            data.data_ptr(),
            out_features,
            data.shape[1],
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
        )
        return y


def load_compact_gemv(cache_root: Path | None = None) -> CompactGemv:
    """The kernel, compiled on first use; NativeBuildError where that is impossible here."""
    library = _build(cache_root or native_cache_root())
    try:
        return CompactGemv(ctypes.CDLL(str(library)))
    except OSError as error:
        raise NativeBuildError(f"cannot load {library}: {error}") from error


def _build(cache_root: Path) -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"no C compiler ({compiler!r} is not on PATH)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    target = cache_root / key / LIBRARY_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a concurrent build or a crash never leaves a
    # half-written library under the final name.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / LIBRARY_NAME
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            first_error = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeBuildError(f"{compiler} failed on {SOURCE.name}: {first_error}")
        built.replace(target)
    logger.info("built the native kernel into %s", target)
    return target
