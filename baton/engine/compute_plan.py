"""What this CPU can do, and the compute plan chosen from it: a pure function, tested per CPU kind.

Detection (`baton/engine/cpu_capabilities.py`) fills a `CpuCapabilities` once at start-up; the
plan is `choose_compute_plan(requested dtype, checkpoint dtype, device, capabilities)`, so every
kind of machine (AVX2-only, AVX-512, AVX512_BF16, AMX) is tested wherever the tests run. Both are
msgspec Structs: they travel unchanged to `/server_info` and into benchmark JSON. Torch-free.
"""

from __future__ import annotations

import msgspec

# ISA levels, lowest first; a level implies the ones before it (as torch and oneDNN dispatch).
ISA_LEVELS = ("default", "avx2", "avx512", "avx512_bf16", "amx")
DTYPES = ("float32", "bfloat16", "float16")

# Why a bf16 checkpoint computes in float32 without native bf16 (AMD EPYC Zen 3, AVX2, 1 thread,
# torch 2.13): unpacked bf16 F.linear against float32 at 16-128 rows, tiny and 0.5B-shape layers.
EMULATED_BF16_COST = "emulated bf16 GEMMs measured 3-10x slower than float32 at 16-128 rows"


def isa_rank(isa: str) -> int:
    """The position of `isa` in ISA_LEVELS (ValueError for an unknown name)."""
    if isa not in ISA_LEVELS:
        raise ValueError(f"unknown CPU ISA {isa!r}; choose one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS.index(isa)


class CpuCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """The CPU as the engine sees it: the figures of any benchmark belong to one of these.

    `isa` is the highest level usable here, after the caps of ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA and `--max-cpu-isa` (`limited_by` names the one that bit, if any);
    `packable_dtypes` are the weight dtypes oneDNN was seen to pack and multiply correctly.
    """

    model_name: str
    num_cpus: int
    isa: str
    detected_isa: str
    limited_by: str | None
    flags: tuple[str, ...]
    torch_capability: str
    packable_dtypes: tuple[str, ...]

    def summary(self) -> str:
        """One line for logs and reports."""
        limit = (
            f" (limited by {self.limited_by}; has {self.detected_isa})" if self.limited_by else ""
        )
        packs = ", ".join(self.packable_dtypes) or "nothing"
        return (
            f"{self.model_name}, {self.num_cpus} cores, ISA {self.isa}{limit}; oneDNN packs {packs}"
        )

    @property
    def native_bf16(self) -> bool:
        """bf16 GEMMs run in hardware (AVX512_BF16 or AMX), not by conversion."""
        return isa_rank(self.isa) >= isa_rank("avx512_bf16") and self.can_pack("bfloat16")

    def can_pack(self, dtype: str) -> bool:
        """oneDNN can hold weights of `dtype` in its blocked layout on this CPU.

        bf16 packing also needs AVX-512 (oneDNN's bf16 path: avx512bw/vl/dq), so a cap below it
        turns packing off even where the hardware would allow it.
        """
        if dtype == "bfloat16" and isa_rank(self.isa) < isa_rank("avx512"):
            return False
        return dtype in self.packable_dtypes


class ComputePlan(msgspec.Struct, frozen=True, kw_only=True):
    """How the engine computes: the dtype of weights, activations and KV cache, whether linear
    weights are packed for oneDNN, and why (logged at start-up)."""

    dtype: str
    pack_weights: bool
    reason: str
    # Float32 linear layers multiply batches of a few rows by the weights as stored (bf16, f16,
    # GGUF blocks) with the native kernel: see baton/engine/compact_weights.py.
    compact_small_batches: bool = False
    # The dtype the decoder layers' linear weights are held and multiplied in, for the batches
    # the compact kernel leaves to oneDNN, where it is not `dtype`: on a native-bf16 CPU a bf16
    # checkpoint computes in float32 (so the native decode step serves small batches) while
    # larger ones cast their rows to bf16 for the hardware's bf16 GEMM. None: `dtype`.
    gemm_dtype: str | None = None
    # On AMX, the compact weights are held once more in the tile unit's order and batches of
    # several rows multiply those on it, where the compact kernel's float32 FMAs bind: bf16
    # weights from 2 rows, prefill chunks included (native/amx_gemm.c, in place of oneDNN's
    # GEMMs, with a prefill's attention on the tiles too: native/amx_attention.c); a GGUF's
    # blocks' integers, scaled per block, from 5-9 rows, prefill chunks included, in float32
    # precision (native/amx_blocks.c).
    amx_tiles: bool = False

    def summary(self) -> str:
        """One line for logs and reports."""
        gemms = f" with {self.gemm_dtype} GEMMs" if self.gemm_dtype else ""
        packed = ", packed weights" if self.pack_weights else ""
        compact = ", small batches read the stored weights" if self.compact_small_batches else ""
        amx = " (batches of several rows in AMX tiles)" if self.amx_tiles else ""
        return f"{self.dtype}{gemms}{packed}{compact}{amx}, because {self.reason}"


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
