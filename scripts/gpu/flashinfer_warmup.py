"""Build ahead the FlashInfer JIT modules that tests/cuda needs for one dtype and head_dim.

    python3 scripts/gpu/flashinfer_warmup.py bfloat16 128 [--gemma] [--done FILE]

FlashInfer compiles each kernel module (one per dtype, head_dim and kernel kind) with nvcc on
first use, one module at a time. This asks Baton's FlashInferAttention to plan the batches the
tests run (a mixed prefill + decode batch; decode-only batches with query groups of 2 and of 4,
the latter on the tensor-core kernels), records the modules those plans ask for instead of
building them, builds them all in one ninja run, and installs each built library where
FlashInfer looks for prebuilt ones (`flashinfer/data/aot/<name>/<name>.so`), so later processes
load it without running ninja again.

Each invocation builds in a workspace of its own: several can run side by side (the run script
starts one per dtype and head_dim, at decreasing priority). `--done FILE` gets "ok" or
"failed" written to it at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

DTYPES = ("bfloat16", "float16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=DTYPES)
    parser.add_argument("head_dim", type=int)
    parser.add_argument(
        "--gemma",
        action="store_true",
        help="Gemma 2's kernels instead: soft-capped scores, with a sliding window and without",
    )
    parser.add_argument("--done", type=Path, help="file to write ok/failed to at the end")
    args = parser.parse_args()
    name = f"{args.dtype}-{args.head_dim}" + ("-gemma" if args.gemma else "")
    tag = f"[{name}]"
    # A private build tree: FlashInfer's ninja runs must not share a build directory.
    workspace = Path("/tmp/flashinfer-warmup") / name
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    ok = False
    try:
        ok = build(args.dtype, args.head_dim, args.gemma, tag)
    except Exception as error:  # report, and let the tests find out for themselves
        print(f"{tag} warm-up failed: {type(error).__name__}: {str(error)[-4000:]}", flush=True)
    if args.done is not None:
        args.done.parent.mkdir(parents=True, exist_ok=True)
        args.done.write_text("ok\n" if ok else "failed\n")
    return 0 if ok else 1


def build(dtype_name: str, head_dim: int, gemma: bool, tag: str) -> bool:
    start = time.monotonic()
    import torch
    from flashinfer.jit import core

    from baton.engine.attention.flashinfer_backend import FlashInferAttention
    from baton.engine.attention.metadata import build_attention_metadata

    dtype = getattr(torch, dtype_name)
    mixed = build_attention_metadata([0, 7, 20], [13, 1, 9], [[0, 1], [2], [3, 4]], 16, "cuda")
    decode = build_attention_metadata([7, 20], [1, 1], [[2], [3, 4]], 16, "cuda")
    specs: list = []

    class Recorded(Exception):
        pass

    def record(spec) -> None:
        specs.append(spec)
        raise Recorded

    original = core.JitSpec.build_and_load
    core.JitSpec.build_and_load = record
    # (heads, batch, windows, soft cap) of each plan; a plan stops at its first module asked
    # for, so each backend here has one window.
    if gemma:  # tests/cuda's Gemma cases: query groups of 2, a window of 16 and none, cap 50
        windows = ((16,), (None,))
        plans = [((8, 4), meta, window, 50.0) for meta in (mixed, decode) for window in windows]
    else:
        plans = [((8, 2), mixed, (None,), None), ((8, 4), decode, (None,), None)]
        plans.append(((8, 2), decode, (None,), None))
    try:
        for (q_heads, kv_heads), meta, windows, softcap in plans:
            backend = FlashInferAttention(
                q_heads,
                kv_heads,
                head_dim,
                dtype,
                "cuda",
                workspace_bytes=16 << 20,
                windows=windows,
                softcap=softcap,
            )
            with contextlib.suppress(Recorded):
                backend.plan(meta)
    finally:
        core.JitSpec.build_and_load = original
    unique = {spec.name: spec for spec in specs}
    todo = [spec for spec in unique.values() if not spec.is_aot]
    print(f"{tag} modules: {sorted(unique)}; to build: {len(todo)}", flush=True)
    core.build_jit_specs(todo, verbose=False)
    for spec in todo:
        built = spec.jit_library_path
        target = spec.aot_path
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".so.partial")
        shutil.copyfile(built, partial)
        os.replace(partial, target)  # atomic: a reader sees the whole library or none
        print(f"{tag} installed {target.name} ({built.stat().st_size >> 20} MiB)", flush=True)
    print(f"{tag} built in {time.monotonic() - start:.0f} s", flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
