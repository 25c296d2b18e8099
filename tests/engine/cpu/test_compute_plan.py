"""The compute plan per kind of CPU (a pure function, so every kind is tested on any machine),
and the detection that feeds it."""

from __future__ import annotations

import pytest
from helpers import SAMPLE_CPU
from msgspec.structs import replace

from baton.engine.cpu.capabilities import (
    detect_cpu_capabilities,
    isa_from_flags,
    onednn_isa_cap,
    parse_cpuinfo,
)
from baton.engine.cpu.compute_plan import choose_compute_plan
from baton.hardware import CpuCapabilities, isa_rank

# What detection reported (or would report) on the machines seen here.
ZEN3 = SAMPLE_CPU  # AMD EPYC Zen 3: AVX2 + FMA, oneDNN packs float32 only
SKYLAKE = replace(
    ZEN3,
    model_name="Intel Xeon (family 6, model 85)",
    isa="avx512",
    detected_isa="avx512",
    flags=("avx2", "avx512bw", "avx512dq", "avx512f", "avx512vl", "fma"),
    torch_capability="AVX512",
    packable_dtypes=("float32", "bfloat16"),
    vendor="GenuineIntel",
)
ZEN5 = replace(
    SKYLAKE,
    model_name="AMD EPYC (family 26, model 2)",
    isa="avx512_bf16",
    detected_isa="avx512_bf16",
    flags=(*SKYLAKE.flags, "avx512_bf16"),
    vendor="AuthenticAMD",
)
SAPPHIRE_RAPIDS = replace(
    ZEN5,
    model_name="Intel Xeon (family 6, model 143)",
    isa="amx",
    detected_isa="amx",
    vendor="GenuineIntel",
)
# The AMX machine run as `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: bf16 packing fails.
AMX_AS_AVX2 = replace(
    SAPPHIRE_RAPIDS,
    isa="avx2",
    detected_isa="amx",
    limited_by="ATEN_CPU_CAPABILITY",
    torch_capability="AVX2",
    packable_dtypes=("float32",),
)


@pytest.mark.parametrize(
    ("caps", "dtype", "packed"),
    [
        (ZEN3, "float32", True),
        (AMX_AS_AVX2, "float32", True),
        (SKYLAKE, "float32", True),  # bf16 by conversion only: float32 is faster
        (ZEN5, "bfloat16", True),
        (SAPPHIRE_RAPIDS, "bfloat16", True),
    ],
    ids=["zen3-avx2", "amx-as-avx2", "avx512", "avx512_bf16", "amx"],
)
@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float16"])
def test_auto_on_a_half_precision_checkpoint_picks_native_bf16_or_float32(
    caps: CpuCapabilities, dtype: str, packed: bool, checkpoint_dtype: str
) -> None:
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", caps)
    assert (plan.dtype, plan.pack_weights) == (dtype, packed)
    assert caps.isa in plan.reason and checkpoint_dtype in plan.reason
    if dtype == "float32":
        assert "no native bf16" in plan.reason


@pytest.mark.parametrize("caps", [ZEN3, SKYLAKE, ZEN5, SAPPHIRE_RAPIDS, AMX_AS_AVX2])
@pytest.mark.parametrize("checkpoint_dtype", ["float32", None])
def test_auto_on_a_float32_checkpoint_stays_float32(
    caps: CpuCapabilities, checkpoint_dtype: str | None
) -> None:
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", caps)
    assert (plan.dtype, plan.pack_weights) == ("float32", True)


@pytest.mark.parametrize(
    ("caps", "packed"),
    [(ZEN3, False), (AMX_AS_AVX2, False), (SKYLAKE, True), (ZEN5, True), (SAPPHIRE_RAPIDS, True)],
)
def test_explicit_bfloat16_is_honoured_everywhere_packed_only_where_onednn_can(
    caps: CpuCapabilities, packed: bool
) -> None:
    plan = choose_compute_plan("bfloat16", "bfloat16", "cpu", caps)
    assert (plan.dtype, plan.pack_weights) == ("bfloat16", packed)
    if not packed:
        assert "not packed" in plan.reason


def test_a_cap_below_avx512_turns_bf16_packing_off_even_if_the_probe_passed() -> None:
    capped = replace(ZEN5, isa="avx2", limited_by="--max-cpu-isa")
    assert not capped.native_bf16 and not capped.can_pack("bfloat16") and capped.can_pack("float32")
    assert choose_compute_plan("auto", "bfloat16", "cpu", capped).dtype == "float32"


def test_float16_is_refused_on_cpu_and_unknown_dtypes_everywhere() -> None:
    with pytest.raises(ValueError, match="float16 is supported on CUDA only"):
        choose_compute_plan("float16", "bfloat16", "cpu", ZEN5)
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        choose_compute_plan("int8", "bfloat16", "cpu", ZEN5)


def test_cuda_keeps_the_checkpoint_dtype_and_never_packs() -> None:
    assert choose_compute_plan("auto", "float16", "cuda", ZEN3).dtype == "float16"
    assert choose_compute_plan("auto", None, "cuda", ZEN3).dtype == "float32"
    plan = choose_compute_plan("float16", "bfloat16", "cuda", ZEN3)
    assert (plan.dtype, plan.pack_weights) == ("float16", False)


ZEN3_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 vaes

processor\t: 1
model name\t: another
"""


def test_float32_gemms_go_to_onednn_on_cpus_not_intels_with_avx512_only() -> None:
    """Where MKL's sgemm runs its AVX2 code (not Intel's CPUs) and oneDNN has AVX-512."""
    assert ZEN5.float32_gemms_in_onednn
    assert not SKYLAKE.float32_gemms_in_onednn and not SAPPHIRE_RAPIDS.float32_gemms_in_onednn
    assert not ZEN3.float32_gemms_in_onednn  # AVX2: both GEMMs run AVX2 code
    assert not replace(ZEN5, vendor="").float32_gemms_in_onednn  # unknown: torch's own
    assert not replace(ZEN5, isa="avx2", limited_by="--max-cpu-isa").float32_gemms_in_onednn
    assert not replace(ZEN5, packable_dtypes=("bfloat16",)).float32_gemms_in_onednn


def test_cpuinfo_names_the_generation_and_reads_the_first_processor() -> None:
    model, vendor, flags = parse_cpuinfo(ZEN3_CPUINFO)
    assert (model, vendor) == ("AMD EPYC (family 25, model 1)", "AuthenticAMD")
    assert {"avx2", "fma", "avx"} <= flags and "avx512f" not in flags
    assert parse_cpuinfo("") == ("unknown", "", set())


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        (set(), "default"),
        ({"avx2"}, "default"),  # AVX2 without FMA is not what torch's AVX2 kernels need
        ({"avx2", "fma"}, "avx2"),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}, "avx2"),  # no avx512dq
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
        (
            {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
            "avx512_bf16",
        ),
        (
            {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
            | {"amx_tile", "amx_bf16"},
            "amx",
        ),
        ({"avx2", "fma", "amx_tile", "amx_bf16"}, "avx2"),  # levels are cumulative
    ],
)
def test_isa_from_flags(flags: set[str], isa: str) -> None:
    assert isa_from_flags(flags) == isa


@pytest.mark.parametrize(
    ("value", "cap"),
    [
        ("", None),
        ("ALL", None),
        ("AVX2", "avx2"),
        ("avx2_vnni", "avx2"),
        ("AVX512_CORE", "avx512"),
        ("AVX512_CORE_VNNI", "avx512"),
        ("AVX512_CORE_BF16", "avx512_bf16"),
        ("AVX512_CORE_AMX", "amx"),
        ("SSE41", "default"),
    ],
)
def test_onednn_max_cpu_isa_values(value: str, cap: str | None) -> None:
    assert onednn_isa_cap(value) == cap


def test_detection_on_this_machine_agrees_with_torch_and_onednn() -> None:
    import torch

    caps = detect_cpu_capabilities()
    assert caps.num_cpus >= 1 and caps.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert "float32" in caps.packable_dtypes
    if caps.torch_capability == "AVX2":
        assert isa_rank(caps.isa) <= isa_rank("avx2") and not caps.native_bf16
    # The probe's verdict is what packing a real bf16 weight does.
    weight = torch.randn(64, 32).bfloat16()
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        packs = True
    except RuntimeError:
        packs = False
    assert ("bfloat16" in caps.packable_dtypes) == packs


def test_max_cpu_isa_only_lowers_the_detected_level() -> None:
    detected = detect_cpu_capabilities()
    capped = detect_cpu_capabilities("avx2")
    assert isa_rank(capped.isa) == min(isa_rank(detected.isa), isa_rank("avx2"))
    assert capped.detected_isa == detected.detected_isa
    if isa_rank(detected.isa) > isa_rank("avx2"):
        assert capped.limited_by == "--max-cpu-isa" and not capped.native_bf16
    assert detect_cpu_capabilities("amx").isa == detected.isa


@pytest.mark.parametrize("caps", [ZEN3, SKYLAKE, ZEN5, SAPPHIRE_RAPIDS, AMX_AS_AVX2])
@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float32"])
def test_compactly_stored_weights_serve_small_batches_on_every_avx2_cpu(
    caps: CpuCapabilities, checkpoint_dtype: str
) -> None:
    """bf16 checkpoints, and GGUFs (whose config says float32), whatever dtype computes."""
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", caps, stored_compactly=True)
    assert plan.compact_small_batches
    assert "small batches read the stored weights" in plan.summary()
    assert not choose_compute_plan("auto", checkpoint_dtype, "cpu", caps).compact_small_batches


@pytest.mark.parametrize("caps", [ZEN3, ZEN5, SAPPHIRE_RAPIDS])
def test_a_gguf_plan_says_gguf_not_float32_checkpoint(caps: CpuCapabilities) -> None:
    """The converted config of a GGUF says float32; the log line names what was loaded."""
    plan = choose_compute_plan("auto", "float32", "cpu", caps, stored_compactly=True, gguf=True)
    assert plan.dtype == "float32" and plan.compact_small_batches
    assert "GGUF checkpoint" in plan.summary() and "float32 checkpoint" not in plan.summary()


@pytest.mark.parametrize("caps", [ZEN3, ZEN5, SAPPHIRE_RAPIDS])
def test_a_gguf_multiplies_its_blocks_in_tiles_on_amx_only(caps: CpuCapabilities) -> None:
    """Its float32 plan keeps float32 precision in the tiles (amx_blocks.c); an explicit bf16
    plan, a cap below AMX or no native kernels, none."""
    plan = choose_compute_plan("auto", "float32", "cpu", caps, stored_compactly=True, gguf=True)
    assert plan.amx_tiles == (caps.isa == "amx")
    assert ("AMX tiles" in plan.summary()) == plan.amx_tiles
    capped = replace(caps, isa="avx512_bf16", limited_by="--max-cpu-isa")
    for plan in (
        choose_compute_plan("bfloat16", "float32", "cpu", caps, stored_compactly=True, gguf=True),
        choose_compute_plan("auto", "float32", "cpu", capped, stored_compactly=True, gguf=True),
        choose_compute_plan("auto", "float32", "cpu", caps, gguf=True),
    ):
        assert not plan.amx_tiles


def test_below_avx2_or_on_cuda_small_batches_read_the_computed_weights() -> None:
    below_avx2 = replace(ZEN3, isa="default", limited_by="--max-cpu-isa")
    plan = choose_compute_plan("auto", "bfloat16", "cpu", below_avx2, stored_compactly=True)
    assert not plan.compact_small_batches
    plan = choose_compute_plan("auto", "bfloat16", "cuda", ZEN3, stored_compactly=True)
    assert not plan.compact_small_batches


@pytest.mark.parametrize("caps", [ZEN5, SAPPHIRE_RAPIDS])
@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float16"])
def test_native_bf16_with_the_native_kernels_computes_float32_with_bf16_gemms(
    caps: CpuCapabilities, checkpoint_dtype: str
) -> None:
    """The native step serves small decode batches (it computes float32); larger batches keep
    the hardware's bf16 GEMMs, their weights packed, the LM head float32 as in every plan."""
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", caps, stored_compactly=True)
    assert (plan.dtype, plan.gemm_dtype) == ("float32", "bfloat16")
    assert plan.pack_weights and plan.compact_small_batches
    assert caps.isa in plan.reason and checkpoint_dtype in plan.reason
    assert plan.summary().startswith("float32 with bfloat16 GEMMs, packed weights")
    # Batches of 2+ rows multiply tiles: on AMX in the tile unit, on AVX512_BF16 without AMX
    # (Zen 4 and 5, or a cap below AMX) with its dot products; below AVX512_BF16, none.
    assert plan.amx_tiles == (caps.isa == "amx")
    assert plan.bf16_dot_tiles == (caps.isa == "avx512_bf16")
    assert ("AMX tiles" in plan.summary()) == plan.amx_tiles
    assert ("bf16 dot products" in plan.summary()) == plan.bf16_dot_tiles
    capped = replace(caps, isa="avx512_bf16", limited_by="--max-cpu-isa")
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", capped, stored_compactly=True)
    assert plan.compact_small_batches and not plan.amx_tiles and plan.bf16_dot_tiles
    below = replace(caps, isa="avx512", limited_by="--max-cpu-isa")
    plan = choose_compute_plan("auto", checkpoint_dtype, "cpu", below, stored_compactly=True)
    assert not plan.amx_tiles and not plan.bf16_dot_tiles
    # Without the native kernels (no C compiler) the whole model computes in bf16, as it did.
    alone = choose_compute_plan("auto", checkpoint_dtype, "cpu", caps)
    assert (alone.dtype, alone.gemm_dtype) == ("bfloat16", None)


@pytest.mark.parametrize("caps", [ZEN3, SKYLAKE, AMX_AS_AVX2, ZEN5, SAPPHIRE_RAPIDS])
def test_bf16_gemms_only_for_auto_on_a_half_precision_checkpoint_with_native_bf16(
    caps: CpuCapabilities,
) -> None:
    for requested, checkpoint_dtype in [
        ("auto", "bfloat16"),
        ("auto", "float32"),
        ("float32", "bfloat16"),
        ("bfloat16", "bfloat16"),
    ]:
        plan = choose_compute_plan(requested, checkpoint_dtype, "cpu", caps, stored_compactly=True)
        mixed = caps.native_bf16 and (requested, checkpoint_dtype) == ("auto", "bfloat16")
        assert (plan.gemm_dtype == "bfloat16") == mixed, (requested, checkpoint_dtype)
        assert plan.dtype == (requested if requested != "auto" else "float32")
