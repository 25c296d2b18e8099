"""Where a CUDA decode step's time goes: Python and launches on the CPU, or kernels on the GPU.

    python3 scripts/gpu/profile_decode.py [--shape qwen2.5-0.5b] [--rows 1,32] [--device cuda]

For each batch size: `rows` prompts of 128 tokens generate `--new-tokens` tokens each (greedy,
ignore_eos) through the offline `LLM`, once to warm up and once under torch.profiler. Printed
per decode token: the wall time, the time the GPU was busy with kernels, how many kernels were
launched and how many times the CPU waited for the GPU (synchronisations and device-to-host
copies); then the ops that took the most CPU time. Written for the finding (2026-11-28, a116f7c)
that a 0.5B decode step took 17 ms on an H200 (docs/benchmarks.md): a step whose GPU time is a small
share of its wall time is bound by the CPU, which CUDA graphs would remove. `--device cpu` runs
the same on the CPU (no GPU columns), to check the script.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from baton import LLM, SamplingParams
from baton.bench.shapes import materialize_shape

PROMPT_TOKENS = 128
# Names of the CUDA calls that launch a kernel (cudaLaunchKernelExC too), and of those in which
# the CPU waits for the GPU.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
try:  # every thread where this torch can; else (TypeError) only this one
    ALL_THREADS: _ExperimentalConfig | None = _ExperimentalConfig(profile_all_threads=True)
except TypeError:
    ALL_THREADS = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    model = materialize_shape(args.shape, Path("/tmp/shapes"), "bfloat16")
    llm = LLM(
        str(model),
        device=args.device,
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    on_gpu = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for rows in (int(text) for text in args.rows.split(",")):
        prompts = [
            [(row * 7919 + i) % 200 + 10 for i in range(PROMPT_TOKENS)] for row in range(rows)
        ]
        llm.generate(prompts, params)  # warm-up: allocations, kernel modules, plans
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall_ms = (time.perf_counter() - start) * 1e3
        # The forwards run on the scheduler's engine thread, not this one: profile every thread.
        with profile(activities=activities, experimental_config=ALL_THREADS) as trace:
            llm.generate(prompts, params)
        events = trace.key_averages()
        steps = args.new_tokens  # one prefill step and new_tokens - 1 decode steps
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        launches = sum(e.count for e in events if e.key.startswith(LAUNCHES))
        waits = sum(e.count for e in events if e.key.startswith(WAITS))
        print(
            f"=== {args.shape}, {rows} rows: {wall_ms / steps:.2f} ms a step (wall, unprofiled)"
            + (
                f", GPU busy {gpu_ms / steps:.2f} ms, {launches / steps:.0f} launches and"
                f" {waits / steps:.1f} waits a step"
                if on_gpu
                else ""
            )
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
