"""The compute plan chosen from what this CPU can do: a pure function, tested per CPU kind.

Detection (`baton/engine/cpu/capabilities.py`) fills a `CpuCapabilities` once at start-up; the
plan is `choose_compute_plan(requested dtype, checkpoint dtype, device, capabilities)`, so every
kind of machine (AVX2-only, AVX-512, AVX512_BF16, AMX) is tested wherever the tests run. Both
types are `baton/hardware.py`'s. Torch-free.
"""

from __future__ import annotations

from baton.hardware import DTYPES, ComputePlan, CpuCapabilities, isa_rank

# Why a bf16 checkpoint computes in float32 without native bf16 (AMD EPYC Zen 3, AVX2, 1 thread,
# torch 2.13): unpacked bf16 F.linear against float32 at 16-128 rows, tiny and 0.5B-shape layers.
EMULATED_BF16_COST = "emulated bf16 GEMMs measured 3-10x slower than float32 at 16-128 rows"


def choose_compute_plan(
    requested: str,
    checkpoint_dtype: str | None,
    device_type: str,
    caps: CpuCapabilities,
    stored_compactly: bool = False,
    gguf: bool = False,
) -> ComputePlan:
    """The plan for `--dtype requested` on a checkpoint stored in `checkpoint_dtype`.

    `auto` on a half-precision checkpoint: a CPU without native bf16 computes in float32
    (EMULATED_BF16_COST); a native-bf16 CPU computes in bf16, or, where the native kernels read
    the stored weights, in float32 with bf16 GEMMs (`ComputePlan.gemm_dtype`), so that decode
    steps of a few rows take the native step and larger batches keep the bf16 hardware. An
    explicit dtype is always honoured where the device has kernels for it. ValueError for a
    dtype the device cannot compute. `stored_compactly`: the checkpoint holds its matrices in
    fewer bytes than float32 (bf16, f16, GGUF blocks) and the native kernels that read them are
    built here (they need AVX2, and every AVX2 CPU also has the FMA and F16C they use). `gguf`:
    the checkpoint is a GGUF file, whose converted config says float32 (the dtype it computes
    in), whatever its blocks store.
    """
    if requested != "auto" and requested not in DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; choose auto, {', '.join(DTYPES)}")
    if device_type != "cpu":
        if requested != "auto":
            return ComputePlan(dtype=requested, pack_weights=False, reason="--dtype " + requested)
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
        return ComputePlan(dtype=dtype, pack_weights=False, reason=f"{dtype} on {device_type}")
    if requested == "float16":
        raise ValueError("float16 is supported on CUDA only; use bfloat16 or float32 on CPU")
    compact = stored_compactly and isa_rank(caps.isa) >= isa_rank("avx2")
    if requested != "auto":
        dtype, reason = requested, "--dtype " + requested
    elif checkpoint_dtype in ("bfloat16", "float16"):
        if caps.native_bf16 and compact and caps.can_pack("float32"):
            return ComputePlan(
                dtype="float32",
                gemm_dtype="bfloat16",
                pack_weights=True,
                compact_small_batches=True,
                amx_tiles=caps.isa == "amx",
                bf16_dot_tiles=caps.isa == "avx512_bf16",
                reason=(
                    f"{checkpoint_dtype} checkpoint, native bf16 ({caps.isa}): decode steps of a "
                    "few rows read the stored weights in the native step, larger batches "
                    "multiply them in bf16 hardware"
                ),
            )
        if caps.native_bf16:
            dtype, reason = "bfloat16", f"{checkpoint_dtype} checkpoint, native bf16 ({caps.isa})"
        else:
            dtype = "float32"
            reason = (
                f"{checkpoint_dtype} checkpoint, but this CPU ({caps.isa}) has no native bf16: "
                + EMULATED_BF16_COST
            )
    elif gguf:
        dtype, reason = "float32", "GGUF checkpoint, computed in float32 as HF does"
    else:
        dtype, reason = "float32", f"{checkpoint_dtype or 'unknown-dtype'} checkpoint"
    pack = caps.can_pack(dtype)
    if not pack:
        reason += f"; {dtype} weights not packed (oneDNN cannot pack them here)"
    if compact:
        reason += "; a decode step is bound by the bytes of weights it reads"
    # A GGUF's blocks multiply in AMX tiles in float32 precision (amx_blocks.c), whatever the
    # rows: only where the plan computes float32, as it does unless told otherwise.
    amx = compact and gguf and dtype == "float32" and caps.isa == "amx"
    return ComputePlan(
        dtype=dtype, pack_weights=pack, reason=reason, compact_small_batches=compact, amx_tiles=amx
    )
