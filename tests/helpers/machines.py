"""A machine description and compute plan for tests that build stats by hand."""

from baton.engine.compute_plan import ComputePlan, CpuCapabilities

SAMPLE_CPU = CpuCapabilities(
    model_name="AMD EPYC (family 25, model 1)",
    num_cpus=2,
    isa="avx2",
    detected_isa="avx2",
    limited_by=None,
    flags=("avx2", "fma"),
    torch_capability="AVX2",
    packable_dtypes=("float32",),
)
SAMPLE_PLAN = ComputePlan(dtype="float32", pack_weights=True, reason="float32 checkpoint")
