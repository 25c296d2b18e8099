"""Micro-benchmark: the scheduler's CPU time per step outside the forward, overlap on and off.

    python -m baton.bench.step_overhead --num-prompts 32 --output-len 128

Runs the same greedy workload through the scheduler core twice (`--disable-overlap` and not),
timing every `Scheduler.step()` and every `Engine.forward` (on the engine thread). Plain loop:
step time minus forward time is the scheduler's own per-step cost. Overlap loop: that work runs
while the forward computes, so what is left of it per step is what the overlap failed to hide.
"""

from __future__ import annotations

import argparse
import random
import time

from baton.bench.output import write_report
from baton.config import BatonConfig
from baton.config_cli import add_config_args, config_from_args
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.scheduler import Scheduler


def measure(config: BatonConfig, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Per-step wall time, forward time and the difference (ms), plus output tokens/s."""
    scheduler = Scheduler(config)
    engine = scheduler.engine
    forward_seconds = 0.0
    forward = engine.forward

    def timed_forward(batch):  # runs on the engine thread
        nonlocal forward_seconds
        start = time.perf_counter()
        try:
            return forward(batch)
        finally:
            forward_seconds += time.perf_counter() - start

    engine.forward = timed_forward
    for index, prompt in enumerate(prompts):
        scheduler.add_request(str(index), prompt, params)
    steps, tokens = 0, 0
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        tokens += sum(len(output.new_token_ids) for output in scheduler.step())
        steps += 1
    elapsed = time.perf_counter() - start
    scheduler.shutdown()
    return {
        "steps": steps,
        "step_ms": elapsed / steps * 1e3,
        "forward_ms": forward_seconds / steps * 1e3,
        "outside_forward_ms": (elapsed - forward_seconds) / steps * 1e3,
        "output_tokens_per_s": tokens / elapsed,
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure both loops and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    rng = random.Random(config.seed)
    prompts = [[rng.randrange(256) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    for name, disable_overlap in (("plain", True), ("overlap", False)):
        run_config = config.replace(disable_overlap=disable_overlap)
        results[name] = measure(run_config, prompts, params)
        figures = results[name]
        print(
            f"{name:>7}: {figures['step_ms']:.2f} ms/step, forward {figures['forward_ms']:.2f} ms, "
            f"outside the forward {figures['outside_forward_ms']:.3f} ms, "
            f"{figures['output_tokens_per_s']:.0f} output tok/s"
        )
    write_report(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
