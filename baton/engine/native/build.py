"""Compiles Baton's native CPU kernels, once per machine, with the C compiler present.

The sources (plain C with AVX2 intrinsics and OpenMP) compile in about 20 s on 2 cores into
`$XDG_CACHE_HOME/baton/native/<hash>/`, keyed by the sources, the flags and the compiler's
version: no torch headers, no build step at install. Where they cannot be built (no compiler, an
unwritable cache) the caller gets a `NativeBuildError` with a one-line reason, and the engine
computes with torch alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Every C file and header under the rooms of this folder (linear/, attention/, layer/, sampling/,
# runtime/): a new kernel is a file in its room, with no list to edit. Sources include headers
# by their room ("runtime/thread_pool.h"), found through -I on this folder.
SOURCES = tuple(sorted(_HERE.glob("*/*.c")))
HEADERS = tuple(sorted(_HERE.glob("*/*.h")))
LIBRARY_NAME = "libbaton_native.so"
# -fopenmp links libgomp by soname: loaded after torch, the library shares torch's OpenMP runtime
# (one thread team, sized by torch.set_num_threads on the calling thread). -ffp-contract=off: a
# C expression rounds as torch's elementwise ops do (RoPE is then bit-identical to the torch
# path); the kernels' explicit FMAs are unaffected.
FLAGS = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-fopenmp",
    "-pthread",
    "-shared",
    "-fPIC",
)


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded here; the message says why, in one line."""


def native_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "baton" / "native"


def build_library(cache_root: Path) -> Path:
    """The compiled library under `cache_root`, built now unless a build of these very sources
    is there already."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"no C compiler ({compiler!r} is not on PATH)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    # Keyed by each file's place too: a move changes what the includes name.
    sources = [
        f"{source.relative_to(_HERE)}\n{source.read_text()}" for source in (*SOURCES, *HEADERS)
    ]
    key = hashlib.sha256("\0".join([*sources, *FLAGS, version]).encode()).hexdigest()[:16]
    target = cache_root / key / LIBRARY_NAME
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: a concurrent build or a crash never leaves
        # a half-written library under the final name.
        scratch_dir = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as error:
        raise NativeBuildError(f"cannot write under {cache_root}: {error}") from error
    with scratch_dir as scratch:
        built = Path(scratch) / LIBRARY_NAME
        objects = [Path(scratch) / f"{index}.o" for index in range(len(SOURCES))]
        # One compiler per source, as many at once as there are CPUs (the compact kernels'
        # file alone takes most of the build), then one link.
        compile_flags = [flag for flag in FLAGS if flag != "-shared"]
        commands = [
            [compiler, *compile_flags, f"-I{_HERE}", "-c", "-o", str(obj), str(source)]
            for source, obj in zip(SOURCES, objects)
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(_run, commands))
        results.append(_run([compiler, *FLAGS, "-o", str(built), *map(str, objects), "-lm"]))
        for result in results:
            if result.returncode != 0:
                first_error = (result.stderr.strip().splitlines() or ["no output"])[0]
                raise NativeBuildError(f"{compiler} failed on the native kernels: {first_error}")
        built.replace(target)
    logger.info("built the native kernels into %s", target)
    return target


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False)
