"""What a CPU can do and how the engine computes on it, as flags name them and as the figures
travel (`/server_info`, scheduler stats, benchmark JSON): ISA levels, dtypes, `CpuCapabilities`
and `ComputePlan`. msgspec Structs, torch-free, so the config, the messages and the frontend read
them without the engine; detecting a CPU and choosing its plan are the engine's
(`baton/engine/cpu/`).
"""

from __future__ import annotations

import msgspec

# ISA levels, lowest first; a level implies the ones before it (as torch and oneDNN dispatch).
ISA_LEVELS = ("default", "avx2", "avx512", "avx512_bf16", "amx")
DTYPES = ("float32", "bfloat16", "float16")


def isa_rank(isa: str) -> int:
    """The position of `isa` in ISA_LEVELS (ValueError for an unknown name)."""
    if isa not in ISA_LEVELS:
        raise ValueError(f"unknown CPU ISA {isa!r}; choose one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS.index(isa)


class CpuCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """The CPU as the engine sees it: the figures of any benchmark belong to one of these.

    `isa` is the highest level usable here, after the caps of ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA and `--max-cpu-isa` (`limited_by` names the one that bit, if any);
    `packable_dtypes` are the weight dtypes oneDNN was seen to pack and multiply correctly;
    `vendor` is /proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where unknown).
    """

    model_name: str
    num_cpus: int
    isa: str
    detected_isa: str
    limited_by: str | None
    flags: tuple[str, ...]
    torch_capability: str
    packable_dtypes: tuple[str, ...]
    vendor: str = ""

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
    def float32_gemms_in_onednn(self) -> bool:
        """Float32 products of unpacked weights (a GGUF's dequantized slabs) go to oneDNN, not
        torch's BLAS: MKL's sgemm runs its AVX2 code on CPUs that are not Intel's, so where such
        a CPU has AVX-512, oneDNN's is the faster GEMM even with the weight packed for each
        call (AMD EPYC Zen 5, 2 threads, an 8192 x 2048 slab: level at 33-64 rows, 1.45x at 128,
        1.7x at 256, 1.9x at 2048)."""
        known_not_intel = self.vendor not in ("", "GenuineIntel")
        return (
            known_not_intel
            and isa_rank(self.isa) >= isa_rank("avx512")
            and self.can_pack("float32")
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
    # GGUF blocks) with the native kernel: see baton/engine/native/formats.py.
    compact_small_batches: bool = False
    # The dtype the decoder layers' linear weights are held and multiplied in, for the batches
    # the compact kernel leaves to oneDNN, where it is not `dtype`: on a native-bf16 CPU a bf16
    # checkpoint computes in float32 (so the native decode step serves small batches) while
    # larger ones cast their rows to bf16 for the hardware's bf16 GEMM. None: `dtype`.
    gemm_dtype: str | None = None
    # On AMX, the compact weights are held once more in the tile unit's order and batches of
    # several rows multiply those on it, where the compact kernel's float32 FMAs bind: bf16
    # weights from 2 rows, prefill chunks included (native/linear/amx_gemm.c, in place of oneDNN's
    # GEMMs, with a prefill's attention on the tiles too: native/attention/amx_attention.c); a
    # GGUF's blocks' integers, scaled per block, from 5-9 rows, prefill chunks included, in float32
    # precision (native/linear/amx_blocks.c).
    amx_tiles: bool = False
    # On AVX512_BF16 CPUs without AMX (AMD Zen 4 and Zen 5), a bf16 checkpoint's compact weights
    # are held once more in the same tile order, and batches of 2 rows or more multiply them
    # with VDPBF16PS (native/linear/bf16_dot_gemm.c), prefill chunks included, in place of
    # oneDNN's bf16 GEMMs: the rows rounded to bf16 as those GEMMs round them.
    bf16_dot_tiles: bool = False

    def summary(self) -> str:
        """One line for logs and reports."""
        gemms = f" with {self.gemm_dtype} GEMMs" if self.gemm_dtype else ""
        packed = ", packed weights" if self.pack_weights else ""
        compact = ", small batches read the stored weights" if self.compact_small_batches else ""
        amx = " (batches of several rows in AMX tiles)" if self.amx_tiles else ""
        dot = " (batches of several rows in bf16 dot products)" if self.bf16_dot_tiles else ""
        return f"{self.dtype}{gemms}{packed}{compact}{amx}{dot}, because {self.reason}"
