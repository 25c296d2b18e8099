"""Offline throughput benchmark, nano-vLLM's shape: N random requests submitted at once, timed.

Prompts are random token ids; input and output lengths are drawn uniformly from
[len * (1 - r), len * (1 + r)] (vLLM's `--random-range-ratio`) with a seed; `ignore_eos=True`, so
exactly the drawn output lengths are generated. `--compare-hf` runs transformers on the same
weights and workload afterwards and prints the throughput ratio.

    python -m baton.bench.offline --shape tiny --compare-hf
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from baton.bench.offline_workload import EngineResult, Workload, make_workload, warmup_workload
from baton.bench.output import write_report
from baton.bench.shapes import DEFAULT_CACHE_DIR, SHAPES, materialize_shape
from baton.bench.transformers_run import run_transformers
from baton.checkpoint.load import load_checkpoint
from baton.config import BatonConfig
from baton.config_cli import add_config_args, config_from_args
from baton.llm import LLM
from baton.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def run_baton(config: BatonConfig, workload: Workload) -> EngineResult:
    """Time `LLM.generate` over the whole workload; the engine is shut down before returning."""
    llm = LLM(**asdict(config))
    try:
        warmup = warmup_workload(llm.engine.vocab_size)
        llm.generate(warmup.prompts, _greedy_params(warmup.output_lens))
        params = _greedy_params(workload.output_lens)
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        elapsed = time.perf_counter() - start
        plan, cpu = llm.engine.plan, llm.engine.cpu
        num_threads = llm.engine.num_threads
    finally:
        llm.scheduler.shutdown()
    generated = [len(output.token_ids) for output in outputs]
    if generated != workload.output_lens:
        logger.warning("Baton generated lengths differ from the requested ones")
    details = {
        "dtype": plan.dtype,
        "compute_plan": msgspec.to_builtins(plan),
        "cpu": msgspec.to_builtins(cpu),
        "disable_overlap": config.disable_overlap,
        "num_threads": num_threads,
    }
    return EngineResult(
        "baton", elapsed, len(outputs), workload.input_tokens, sum(generated), details
    )


def _greedy_params(output_lens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark flags (vLLM's names) plus every engine flag of `baton.config`."""
    parser = argparse.ArgumentParser(prog="python -m baton.bench.offline", description=__doc__)
    add_config_args(parser)  # defines --model, --dtype and --seed too
    group = parser.add_argument_group("benchmark")
    group.add_argument("--shape", choices=sorted(SHAPES), help="random weights of a named shape")
    group.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    group.add_argument("--num-prompts", type=int, default=None, help="default: from the shape")
    group.add_argument("--random-input-len", type=int, default=None, help="default: from shape")
    group.add_argument("--random-output-len", type=int, default=None, help="default: from shape")
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="lengths uniform in len*(1-r)..len*(1+r) (vLLM defaults to 0: fixed lengths)",
    )
    group.add_argument("--output-json", type=Path, default=None)
    group.add_argument("--compare-hf", action="store_true", help="also run transformers")
    group.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and return the results (also written to `--output-json`)."""
    args = build_parser().parse_args(argv)
    if args.model and args.shape:
        raise SystemExit("give --model or --shape, not both")
    shape = SHAPES[args.shape or "tiny"]
    if args.model is None:
        # bf16 weights, as real checkpoints; `--dtype auto` computes them as this CPU's plan says.
        weights_dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        model = str(materialize_shape(shape.name, args.cache_dir, weights_dtype))
    else:
        model = args.model
    defaults = shape.bench_workload
    workload = make_workload(
        args.num_prompts or defaults.num_prompts,
        args.random_input_len or defaults.input_len,
        args.random_output_len or defaults.output_len,
        args.random_range_ratio,
        load_checkpoint(model).config.vocab_size,
        args.seed,
    )
    baton = run_baton(config_from_args(args).replace(model=model), workload)
    gc.collect()  # free Baton's weights and KV pool before transformers loads its copy
    hf = None
    if args.compare_hf:
        # Same compute dtype and as many math threads as Baton's engine: only the engines differ.
        details = baton.details
        hf = run_transformers(
            model, details["dtype"], workload, args.hf_batch_size, details["num_threads"]
        )
    report = _report(args, model, workload, baton, hf)
    write_report(args.output_json, report)
    return report


def _report(
    args: argparse.Namespace,
    model: str,
    workload: Workload,
    baton: EngineResult,
    hf: EngineResult | None,
) -> dict[str, Any]:
    """Print the figures and return them as one JSON-ready dict."""
    report: dict[str, Any] = {
        "model": model,
        "shape": args.shape,
        "num_prompts": len(workload.prompts),
        "random_range_ratio": args.random_range_ratio,
        "seed": args.seed,
        "input_lens": [len(prompt) for prompt in workload.prompts],
        "output_lens": workload.output_lens,
        "total_input_tokens": workload.input_tokens,
        "total_output_tokens": workload.output_tokens,
        "baton": baton.to_dict(),
    }
    print(
        f"{len(workload.prompts)} requests, {workload.input_tokens} input tokens, "
        f"{workload.output_tokens} output tokens ({model})"
    )
    for result in (baton, hf):
        if result is not None:
            print(
                f"{result.engine:>12}: {result.elapsed_s:8.2f} s, "
                f"{result.output_throughput:9.1f} output tok/s, "
                f"{result.total_throughput:9.1f} total tok/s"
            )
    if hf is not None:
        report["transformers"] = hf.to_dict()
        report["baton_vs_transformers"] = baton.output_throughput / hf.output_throughput
        print(f"Baton / transformers: {report['baton_vs_transformers']:.2f}x output tok/s")
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
