"""transformers' side of the offline benchmark (`--compare-hf`, and bench.compare's
transformers engine): greedy `generate` in static batches over the same workload."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from baton.bench.offline_workload import EngineResult, Workload, warmup_workload
from baton.checkpoint.source import GGUF_SUFFIX
from baton.engine.cpu.vector_math import initialize_vector_math


def run_transformers(
    model: str, dtype: str, workload: Workload, batch_size: int, num_threads: int
) -> EngineResult:
    """Time transformers' greedy `generate` in static, left-padded batches on `num_threads`.

    Requests are sorted by output length (longest first) before batching, so each batch's rows
    need nearly the same number of steps: static batching's best case. A batch generates its
    longest request's length (`min_new_tokens` = `max_new_tokens` rules out early EOS), and
    only each request's own length counts as output; the rest is reported as wasted tokens.
    """
    from transformers import AutoModelForCausalLM

    # MKL's vector math set up on one thread before transformers' RoPE tables use several.
    initialize_vector_math()
    torch.set_num_threads(num_threads)
    path = Path(model)
    if path.suffix == GGUF_SUFFIX:  # transformers dequantizes a GGUF, as Baton does
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf_model.eval()
    pad_id = hf_model.generation_config.pad_token_id or 0
    order = sorted(range(len(workload.prompts)), key=lambda i: -workload.output_lens[i])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    warmup = warmup_workload(hf_model.config.vocab_size)
    _hf_generate(hf_model, warmup.prompts, warmup.output_lens[0], pad_id)
    computed = 0
    start = time.perf_counter()
    for batch in batches:
        longest = max(workload.output_lens[i] for i in batch)
        _hf_generate(hf_model, [workload.prompts[i] for i in batch], longest, pad_id)
        computed += longest * len(batch)
    elapsed = time.perf_counter() - start
    details = {
        "dtype": dtype,
        "batch_size": batch_size,
        "num_threads": torch.get_num_threads(),
        "wasted_tokens": computed - workload.output_tokens,
    }
    counts = (len(order), workload.input_tokens, workload.output_tokens)
    return EngineResult("transformers", elapsed, *counts, details)


@torch.inference_mode()
def _hf_generate(
    hf_model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> None:
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = hf_model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
    )
    if output.shape[1] - width != new_tokens:
        raise RuntimeError(f"transformers generated {output.shape[1] - width}, not {new_tokens}")
