"""A machine description, compute plan and scheduler stats for tests that build stats by hand."""

from baton.hardware import ComputePlan, CpuCapabilities
from baton.scheduler_stats import AggregateStats

SAMPLE_CPU = CpuCapabilities(
    model_name="AMD EPYC (family 25, model 1)",
    num_cpus=2,
    isa="avx2",
    detected_isa="avx2",
    limited_by=None,
    flags=("avx2", "fma"),
    torch_capability="AVX2",
    packable_dtypes=("float32",),
    vendor="AuthenticAMD",
)
SAMPLE_PLAN = ComputePlan(dtype="float32", pack_weights=True, reason="float32 checkpoint")
# A scheduler that has served a little: two running (one paused), one waiting.
SAMPLE_STATS = AggregateStats(
    running_requests=2, waiting_requests=1, paused_requests=1, total_pages=10, free_pages=5,
    cached_pages=1, used_pages=4, peak_used_pages=7, peak_memory_bytes=3 << 30,
    finished_requests=3, prompt_tokens=30, cached_prompt_tokens=8, generated_tokens=40,
    preemptions=1, spec_decode_num_drafts=5, spec_decode_num_draft_tokens=20,
    spec_decode_num_accepted_tokens=12, uptime=1.0, generation_throughput=40.0,
    cpu=SAMPLE_CPU, compute_plan=SAMPLE_PLAN,
)  # fmt: skip
