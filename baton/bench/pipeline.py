"""Micro-benchmark: per-token overhead of the process pipeline (ZMQ client vs in-process LLM).

    python -m baton.bench.pipeline --model ../shared/models/stories260K --dtype float32

One request of `--output-len` greedy tokens (ignore_eos), best of `--repeats`, first through
`baton.LLM` in this process, then through a launched server and `baton.client.BatonClient`
(tokenizer -> scheduler -> detokenizer -> client). The difference per token is what the pipeline
costs a single stream.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from baton.bench.output import write_report
from baton.bench.peers import free_port
from baton.client import BatonClient
from baton.config import BatonConfig
from baton.config_cli import add_config_args, config_from_args
from baton.launch import Server
from baton.llm import LLM
from baton.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


def time_in_process(config: BatonConfig, params: SamplingParams, repeats: int) -> float:
    """Best wall time of one request through the offline LLM."""
    llm = LLM(**dataclasses.asdict(config))
    llm.generate(PROMPT, params)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(PROMPT, params)
        best = min(best, time.perf_counter() - start)
    llm.scheduler.shutdown()
    return best


def time_through_server(config: BatonConfig, params: SamplingParams, repeats: int) -> float:
    """Best wall time of one request through a launched server and the ZMQ client."""

    async def measure(server: Server) -> float:
        async with BatonClient(server.addresses.requests, server.addresses.replies) as client:
            await client.generate(PROMPT, params)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                await client.generate(PROMPT, params)
                best = min(best, time.perf_counter() - start)
            return best

    with Server(config.replace(port=free_port())) as server:
        return asyncio.run(measure(server))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run both measurements and print the per-token figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    config = config_from_args(args).replace(log_level="warning")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    in_process = time_in_process(config, params, args.repeats) / args.output_len
    server = time_through_server(config, params, args.repeats) / args.output_len
    result = {
        "in_process_ms_per_token": in_process * 1e3,
        "zmq_client_ms_per_token": server * 1e3,
        "overhead_ms_per_token": (server - in_process) * 1e3,
    }
    print(
        f"in-process LLM: {result['in_process_ms_per_token']:.3f} ms/token; "
        f"ZMQ client: {result['zmq_client_ms_per_token']:.3f} ms/token; "
        f"overhead: {result['overhead_ms_per_token']:.3f} ms/token"
    )
    write_report(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
