"""Speculative decoding benchmark (issue 15): the same server with speculation off, then on.

    python -m baton.bench.speculative --output-json spec.json
    python -m baton.bench.speculative --speculative-config \
        '{"method": "draft_model", "model": "/models/draft.gguf", "num_speculative_tokens": 4}'

Baton is launched twice in turn, with the same flags (`--model`, `--server-args`) except for
`--speculative-config` on the second run. Each server is warmed up with one short request, then
measured on every workload x concurrency cell with `baton.bench.serving`'s client: chat requests
(/v1/chat/completions), greedy, `ignore_eos` with a fixed output length (`max_tokens` and
`min_tokens`, as every serving benchmark here), so both servers generate the same tokens and tok/s
compare. Workloads:

- `repetitive`: rewrite a 40-line window of Baton's own Python with one name changed
  (`workloads.code_edit_requests`), so a correct answer quotes most of the prompt;
- `random`: random words (`--random-input-len` of them), where drafts rarely match.

Each cell sends `--num-prompts` requests (at least its concurrency) and reads the server's
`baton:spec_decode_*` counters from /metrics before and after it: acceptance rate = accepted /
draft tokens, accepted per step = accepted / drafts (vLLM's mean acceptance length is one more).
Cells at the same concurrency draw the same prompts on both servers; each concurrency level
draws its own (seed + level index), so none is served from a prefix cache an earlier one filled.
The table gives output tok/s, median TPOT and median TTFT off and on, the speed-up (on tok/s /
off tok/s) and the acceptance; the JSON report holds every cell's full serving results too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.machine import describe_machine, machine_line
from baton.bench.output import write_report
from baton.bench.peers import ServerCommand, ServerProcess, free_port
from baton.bench.serving import add_serving_args, run_benchmark
from baton.bench.speculative_report import (
    Cell,
    counter_delta,
    fetch_spec_counters,
    format_table,
    summarize_cells,
    target_line,
)
from baton.bench.workloads import CHAT_ENDPOINT, code_edit_requests
from baton.checkpoint.source import default_model
from baton.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
WORKLOADS = ("repetitive", "random")
# /metrics counters (vLLM's names with Baton's prefix), and the short keys they get here.
WARMUP_OUTPUT_LEN = 16
WARMUP_SEED = 1_000_003  # far from the cells' seeds: the warm-up prompt is none of theirs


def _levels(text: str) -> list[int]:
    levels = [int(level) for level in text.split(",") if level.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers like 1,16, got {text!r}")
    return levels


def _workloads(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(WORKLOADS):
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOADS)}, got {text!r}")
    return names


def _speculative_config(text: str) -> str:
    """The JSON as given (passed on to the server), checked here first so mistakes fail fast."""
    try:
        SpeculativeConfig.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (vLLM's names where vLLM has them)."""
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="default: Baton's (SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=DEFAULT_SPECULATIVE_CONFIG,
        help=f"the second server's, as JSON (default: {DEFAULT_SPECULATIVE_CONFIG})",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help='flags for both servers, e.g. --server-args="--max-num-seqs 16 --dtype float32"',
    )
    parser.add_argument(
        "--workloads", type=_workloads, default=list(WORKLOADS), help="default: repetitive,random"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=4, help="requests per cell (at least its concurrency)"
    )
    parser.add_argument("--max-concurrency", type=_levels, default=[1, 16], help="default: 1,16")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request makes")
    parser.add_argument("--random-input-len", type=int, default=128, help="words, random workload")
    parser.add_argument("--code-lines", type=int, default=40, help="lines, repetitive workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds to healthy")
    parser.add_argument("--output-json", type=Path, default=None)
    return parser


def server_command(
    model: str | None, port: int, server_args: Sequence[str], speculative_config: str | None
) -> ServerCommand:
    """`python -m baton.launch` on 127.0.0.1:`port` (no --model: Baton's default model)."""
    argv = [sys.executable, "-m", "baton.launch"]
    argv += ["--model", model] if model else []
    argv += ["--host", "127.0.0.1", "--port", str(port), *server_args]
    argv += ["--speculative-config", speculative_config] if speculative_config else []
    return ServerCommand("baton", argv)


def cells(args: argparse.Namespace) -> list[Cell]:
    """Every workload x concurrency cell, in the order they run."""
    return [
        Cell(workload, level, index)
        for workload in args.workloads
        for index, level in enumerate(args.max_concurrency)
    ]


def serving_args(
    args: argparse.Namespace, cell: Cell, base_url: str, work_dir: Path
) -> argparse.Namespace:
    """`baton.bench.serving`'s flags for one cell: its defaults, with the cell's workload (the
    repetitive one through a JSONL file, which the serving client reads as any dataset)."""
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    bench = parser.parse_args([])
    bench.base_url, bench.endpoint, bench.disable_tqdm = base_url, CHAT_ENDPOINT, True
    bench.num_prompts = max(args.num_prompts, cell.max_concurrency)
    bench.max_concurrency, bench.seed = cell.max_concurrency, args.seed + cell.index
    bench.random_output_len = args.output_len
    if cell.workload == "random":
        bench.dataset_name, bench.random_prompt_text = "random", True
        bench.random_input_len = args.random_input_len
    else:
        requests = code_edit_requests(
            bench.num_prompts, bench.seed, args.output_len, window_lines=args.code_lines
        )
        path = work_dir / f"repetitive-{cell.index}.jsonl"
        lines = [
            json.dumps({"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.output_len})
            for r in requests
        ]
        path.write_text("\n".join(lines) + "\n")
        bench.dataset_name, bench.dataset_path = "jsonl", path
    return bench


def warmup_args(base_url: str) -> argparse.Namespace:
    """One short random-words chat request, to warm the server before the first cell."""
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    bench = parser.parse_args([])
    bench.base_url, bench.endpoint, bench.disable_tqdm = base_url, CHAT_ENDPOINT, True
    bench.num_prompts, bench.random_input_len, bench.random_prompt_text = 1, 32, True
    bench.random_output_len, bench.seed = WARMUP_OUTPUT_LEN, WARMUP_SEED
    return bench


def run_cell(bench: argparse.Namespace) -> dict[str, Any]:
    """One cell on a running server: its serving result plus its `spec_counters` deltas."""
    before = fetch_spec_counters(bench.base_url)
    result = asyncio.run(run_benchmark(bench))
    result["spec_counters"] = counter_delta(before, fetch_spec_counters(bench.base_url))
    return result


def run_server(
    args: argparse.Namespace, speculative_config: str | None, work_dir: Path
) -> dict[str, Any]:
    """Launch Baton (speculation on when a config is given), warm it, run every cell, stop it."""
    port = free_port()
    command = server_command(args.model, port, shlex.split(args.server_args), speculative_config)
    side = "on" if speculative_config else "off"
    logger.info("speculation %s: %s", side, shlex.join(command.argv))
    record: dict[str, Any] = {"command": command.argv, "results": []}
    with ServerProcess(command, port, work_dir / f"baton-{side}.log") as server:
        server.start(args.server_timeout)
        asyncio.run(run_benchmark(warmup_args(server.base_url)))
        for cell in cells(args):
            result = run_cell(serving_args(args, cell, server.base_url, work_dir))
            result["workload"] = cell.workload
            record["results"].append(result)
            logger.info(
                "speculation %s, %s at concurrency %d: %.1f tok/s",
                side, cell.workload, cell.max_concurrency, result["output_throughput"],
            )  # fmt: skip
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: off run, on run, the table printed; the report returned (and saved)."""
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 2:
        raise SystemExit("need --num-prompts >= 1 and --output-len >= 2 (TPOT needs two tokens)")
    machine = describe_machine()  # before any server starts: the machine is quiet
    print(machine_line(machine), flush=True)
    with tempfile.TemporaryDirectory(prefix="baton-speculative-") as work:
        off = run_server(args, None, Path(work))
        on = run_server(args, args.speculative_config, Path(work))
    rows = summarize_cells(cells(args), off["results"], on["results"])
    print(machine_line(machine))
    print(f"Model: {args.model or default_model()}; speculative config: {args.speculative_config}")
    print(format_table(rows))
    if line := target_line(rows):
        print(line)
    report = {
        "machine": machine,
        "model": args.model or default_model(),
        "speculative_config": json.loads(args.speculative_config),
        "server_args": shlex.split(args.server_args),
        "workload": {
            "workloads": args.workloads,
            "num_prompts": args.num_prompts,
            "max_concurrency": args.max_concurrency,
            "output_len": args.output_len,
            "random_input_len": args.random_input_len,
            "code_lines": args.code_lines,
            "seed": args.seed,
        },
        "cells": rows,
        "servers": {"off": off, "on": on},
    }
    write_report(args.output_json, report)
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
