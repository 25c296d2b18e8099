"""The scale-out flags of the command line (baton/distributed/, baton/router_proc/): tensor,
pipeline and data parallelism and several nodes, named as vLLM's and SGLang's."""

from __future__ import annotations

import argparse

from baton.config import LOAD_BALANCE_METHODS, BatonConfig


def add_scale_out_args(parser: argparse.ArgumentParser, defaults: BatonConfig) -> None:
    """Their own group of `parser`'s flags."""
    group = parser.add_argument_group("scale-out")
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        dest="tensor_parallel_size",
        type=int,
        default=defaults.tensor_parallel_size,
        help="shard the model over this many ranks, one process each (torch.distributed: gloo "
        "on CPU, NCCL on CUDA)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        "--pp-size",
        dest="pipeline_parallel_size",
        type=int,
        default=defaults.pipeline_parallel_size,
        help="split the model's layers into this many stages, one process each, with as many "
        "micro-batches in flight (torch.distributed, as for --tensor-parallel-size)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        "--dp-size",
        dest="data_parallel_size",
        type=int,
        default=defaults.data_parallel_size,
        help="engine replicas (each of --tensor-parallel-size x --pipeline-parallel-size ranks) "
        "behind one frontend",
    )
    group.add_argument(
        "--load-balance-method",
        default=defaults.load_balance_method,
        choices=LOAD_BALANCE_METHODS,
        help="which replica takes a request: in turn, the one with the fewest tokens running "
        "and waiting, or the one holding the longest prefix of its prompt unless it is "
        "loaded well past the others",
    )
    group.add_argument(
        "--nnodes",
        type=int,
        default=defaults.nnodes,
        help="machines a replica's ranks are spread over; each runs `baton launch` with "
        "the same flags and its --node-rank",
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=defaults.node_rank,
        help="this machine's place among --nnodes: 0 serves, the others run ranks only",
    )
    group.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT where rank 0 waits for the other ranks to join (default: a free port "
        "on 127.0.0.1)",
    )
    group.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=defaults.distributed_timeout_seconds,
        help="how long ranks wait to join, and a collective waits on a rank, before the "
        "server stops",
    )
