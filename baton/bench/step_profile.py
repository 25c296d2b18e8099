"""Micro-benchmark: where one engine step's time goes, the engine alone (no server).

    python -m baton.bench.step_profile --rows 1,16 --context 200 --prefill-tokens 1024

For each batch size: a decode step of that many rows (each with `--context` cached tokens)
through the native decode step and through the model's forward op by op (`--enforce-eager`),
then the pieces alone on the same weights and caches: every linear layer's matmul at that many
rows, and the decode attention of every layer. Then one prompt of `--prefill-tokens` tokens:
its forward against its linear layers alone at as many rows (prefill's share of the GEMM rate).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from baton.bench.output import write_report
from baton.config import BatonConfig
from baton.config_cli import add_config_args, config_from_args
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.batch.forward_batch import ForwardBatch
from baton.engine.engine import Engine
from baton.engine.models.layers import Linear
from baton.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0, max_tokens=1)


def _ms(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: first-touch of caches and weights
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats * 1e3


def _batch(engine: Engine, starts: list[int], q_lens: list[int]) -> ForwardBatch:
    pages = -(-(max(starts) + max(q_lens)) // engine.page_size)
    rows = range(len(q_lens))
    # Distinct tokens, spread over the vocabulary: a mixture of experts routes each to its own
    # experts, as a served batch's rows are; one token repeated would read 8 experts a layer.
    tokens = [(7 + 7919 * i) % engine.vocab_size for i in range(sum(q_lens))]
    return ForwardBatch(
        tokens, starts, q_lens, [list(range(r * pages, (r + 1) * pages)) for r in rows],
        list(rows), list(rows), [_GREEDY] * len(q_lens), [None] * len(q_lens), [[] for _ in rows],
    )  # fmt: skip


def profile_decode(engine: Engine, eager: Engine, rows: int, context: int, repeats: int) -> dict:
    """Milliseconds of one decode step of `rows` rows, whole and by piece."""
    batch = _batch(engine, [context] * rows, [1] * rows)
    figures = {
        "native_step_ms": _ms(lambda: engine.forward(batch), repeats)
        if engine.decode_step is not None
        else None,
        "eager_step_ms": _ms(lambda: eager.forward(batch), repeats),
    }
    linears = [m for m in eager.model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(rows, m.in_features, dtype=eager.dtype) for m in linears]
    figures["linear_layers_ms"] = _ms(
        lambda: [linear(x) for linear, x in zip(linears, inputs)], repeats
    )
    meta = build_attention_metadata(
        batch.kv_starts, batch.q_lens, batch.page_tables, eager.page_size
    )
    eager.attention.plan(meta)
    config = eager.model_config
    q = torch.randn(rows, config.num_heads, config.head_dim, dtype=eager.dtype)
    pool, scale = eager.kv_pool, config.head_dim**-0.5

    def attention() -> None:
        for layer in range(config.num_layers):
            eager.attention.forward(q, pool.k_cache(layer), pool.v_cache(layer), meta, scale)

    figures["decode_attention_ms"] = _ms(attention, repeats)
    return figures


def profile_prefill(engine: Engine, tokens: int) -> dict:
    """One prompt's forward against its linear layers alone at as many rows (FLOPs of the linear
    layers only; the LM head, which computes one row, left out)."""
    batch = _batch(engine, [0], [tokens])
    forward_ms = _ms(lambda: engine.forward(batch), 2)
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    linears.remove(engine.model.lm_head)
    inputs = [torch.randn(tokens, m.in_features, dtype=engine.dtype) for m in linears]
    gemm_ms = _ms(lambda: [linear(x) for linear, x in zip(linears, inputs)], 2)
    flops = 2 * tokens * sum(m.in_features * m.out_features for m in linears)
    return {
        "prefill_ms": forward_ms,
        "prefill_gflops": flops / forward_ms / 1e6,
        "linear_layers_gflops": flops / gemm_ms / 1e6,
        "share_of_gemm_rate": gemm_ms / forward_ms,
    }


def main(argv: list[str] | None = None) -> dict:
    """Profile and print; `--output-json` keeps the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--rows", default="1,16", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=200, help="cached tokens per decode row")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    rows = [int(n) for n in args.rows.split(",") if n.strip().isdigit()]
    if len(rows) != len(args.rows.split(",")) or min(rows) < 1:
        parser.error(f"--rows takes positive integers, comma-separated; got {args.rows!r}")
    config: BatonConfig = config_from_args(args)
    longest = max(args.context + 1, args.prefill_tokens)
    pages = max(rows) * -(-longest // config.page_size) + 1
    config = config.replace(
        num_pages=pages, max_model_len=longest, max_running_requests=max(*rows, 2)
    )
    engine = Engine(config)
    eager = Engine(config.replace(enforce_eager=True), engine.checkpoint)
    results: dict = {"model": engine.checkpoint.name, "plan": engine.plan.summary(), "decode": {}}
    for count in rows:
        figures = profile_decode(engine, eager, count, args.context, args.repeats)
        results["decode"][count] = figures
        print(f"{count} rows: " + ", ".join(
            f"{name} {value:.2f}" for name, value in figures.items() if value is not None
        ))  # fmt: skip
    results["prefill"] = profile_prefill(engine, args.prefill_tokens)
    print(f"{args.prefill_tokens}-token prefill: " + ", ".join(
        f"{name} {value:.2f}" for name, value in results["prefill"].items()
    ))  # fmt: skip
    write_report(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
