"""What a narrower --kv-cache-dtype costs in accuracy, the engine alone (no server):

    python -m baton.bench.kv_accuracy --model PATH_OR_GGUF [--tokens 512] [--chunk 128]

A fixed text (kv_accuracy_text.py: the opening of The Tale of Peter Rabbit, public domain) is
tokenized, cut to `--tokens` tokens, and teacher-forced through the model once per KV cache
dtype: prefill chunks of `--chunk` tokens, each attending over the cache the text so far was
written into (the kernels the server runs: on a float32 plan with AVX2 the native ones), every
position's logits kept. Against the float32 cache's logits each dtype reports the text's
perplexity, the largest and the mean |logit difference| (over every position and token) and the
share of positions whose argmax agrees, with the KV bytes a token takes. Speed is not measured:
this is accuracy and memory only.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import torch

from baton.bench.kv_accuracy_text import PETER_RABBIT
from baton.bench.output import write_report
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.source import default_model
from baton.config import BatonConfig
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.engine import Engine
from baton.engine.kv.sizing import page_bytes

REFERENCE = "float32"
DEFAULT_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


def teacher_forced_logits(engine: Engine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of every position of `token_ids`, run through
    `engine`'s model in prefill chunks of `chunk` tokens over the pool's first pages."""
    pages = [list(range(-(-len(token_ids) // engine.page_size)))]
    logits = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start : start + chunk]
        meta = build_attention_metadata([start], [len(ids)], pages, engine.page_size)
        engine.attention.plan(meta)
        rows = torch.arange(len(ids))
        logits.append(
            engine.model(
                torch.tensor(ids), meta.positions, engine.kv_pool, engine.attention, meta, rows
            )
        )
    return torch.cat(logits)


def compare(
    logits: torch.Tensor, reference: torch.Tensor, token_ids: list[int]
) -> dict[str, float]:
    """The text's perplexity under `logits` (position i predicting token i + 1), and how far
    `logits` lie from `reference`'s: largest and mean |difference|, argmax agreement."""
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[1:]).unsqueeze(1)
    difference = (logits - reference).abs()
    return {
        "perplexity": math.exp(-float(log_probs.gather(1, targets).mean())),
        "max_abs_logit_diff": float(difference.max()),
        "mean_abs_logit_diff": float(difference.mean()),
        "argmax_agreement": float((logits.argmax(-1) == reference.argmax(-1)).double().mean()),
    }


def measure(model: str, names: list[str], tokens: int, chunk: int, max_cpu_isa: str | None) -> dict:
    """float32 (the reference), then every other dtype of `names`, on the first `tokens` tokens
    of the text; the report's "dtypes" lists them in that order."""
    checkpoint = load_checkpoint(model)
    token_ids = checkpoint.tokenizer.encode(PETER_RABBIT)
    token_ids = token_ids[: min(tokens, checkpoint.config.max_position_embeddings)]
    config = BatonConfig(
        model=model, max_model_len=len(token_ids), max_running_requests=1, max_cpu_isa=max_cpu_isa
    )
    config = config.replace(num_pages=-(-len(token_ids) // config.page_size))
    dtypes = [REFERENCE, *(name for name in names if name != REFERENCE)]
    report: dict[str, Any] = {"model": checkpoint.name, "tokens": len(token_ids), "chunk": chunk}
    report["dtypes"] = dtypes
    reference = None
    for name in dtypes:
        engine = Engine(config.replace(kv_cache_dtype=name), checkpoint)
        report.setdefault("plan", engine.plan.summary())
        report.setdefault("cpu", engine.cpu.summary())
        logits = teacher_forced_logits(engine, token_ids, chunk)
        reference = logits if reference is None else reference
        figures = compare(logits, reference, token_ids)
        figures["kv_bytes_per_token"] = page_bytes(engine.model_config, 1, engine.kv_dtype)
        report[name] = figures
        del engine  # one model's weights and pool at a time
    return report


def format_table(report: dict) -> str:
    """The report as a markdown table, one row per KV cache dtype."""
    lines = [
        "| KV cache dtype | KV bytes / token | perplexity | max abs logit diff "
        "| mean abs logit diff | argmax agrees |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name in report["dtypes"]:
        row = report[name]
        lines.append(
            f"| {name} | {row['kv_bytes_per_token']:,} | {row['perplexity']:.4f} "
            f"| {row['max_abs_logit_diff']:.4f} | {row['mean_abs_logit_diff']:.5f} "
            f"| {100 * row['argmax_agreement']:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Measure and print the table; `--output-json` keeps the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a folder or GGUF (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text forced")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per prefill chunk")
    parser.add_argument(
        "--kv-cache-dtypes",
        default=",".join(DEFAULT_DTYPES),
        help="comma-separated --kv-cache-dtype values (float32, the reference, always runs)",
    )
    parser.add_argument("--max-cpu-isa", default=None, help="as baton launch's flag")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = [name for name in args.kv_cache_dtypes.split(",") if name]
    if args.tokens < 2 or args.chunk < 1:
        parser.error("--tokens takes at least 2, --chunk at least 1")
    model = args.model or default_model()
    report = measure(model, names, args.tokens, args.chunk, args.max_cpu_isa)
    print(f"{report['model']}: {report['tokens']} tokens in chunks of {args.chunk}")
    print(f"plan: {report['plan']}\nCPU: {report['cpu']}")
    print(format_table(report))
    write_report(args.output_json, report)
    return report


if __name__ == "__main__":
    main()
