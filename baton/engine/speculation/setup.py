"""Building an engine's speculator from `--speculative-config`: the drafter, and the draft budget
with this machine's measured step cost. The engine hands over what the speculator needs of it
(`TargetEngine`): speculation imports nothing above it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.config import BatonConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.speculation.draft_budget import DraftBudget, StepCost
from baton.engine.speculation.draft_model import DraftModel
from baton.engine.speculation.drafter import Drafter, NgramDrafter
from baton.engine.speculation.speculator import Speculator

logger = logging.getLogger(__name__)

# Rows of the larger step timed at start-up (with one row: the fixed and the per-row cost).
_TIMED_ROWS = 16


@dataclass(frozen=True)
class TargetEngine:
    """What a speculator needs of the engine whose tokens it drafts."""

    vocab_size: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype  # its KV pool's (--kv-cache-dtype), which a draft model's pool shares
    gemm_dtype: torch.dtype | None
    # Rows a verifying step may take at most (None: no cap), as the engine's plan decides.
    max_rows: int | None
    # Runs one decode step of that many rows on idle pages: timed at start-up for its cost.
    run_idle_step: Callable[[int], None]
    # Its tensor-parallel ranks, whose speculators must trim their drafts alike (`_agreed`).
    tp: TensorParallel


def make_speculator(config: BatonConfig, target: TargetEngine) -> Speculator | None:
    """The engine's speculator, None without `--speculative-config`."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        drafter: Drafter = NgramDrafter(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    else:
        drafter = DraftModel(
            spec,
            config,
            target.vocab_size,
            target.num_pages,
            target.dtype,
            target.kv_dtype,
            target.gemm_dtype,
        )
    many_rows = min(_TIMED_ROWS, target.num_pages * target.page_size)
    cost = _agreed(StepCost.measure(target.run_idle_step, many_rows), target.tp, config.device)
    logger.info(
        "speculative decoding: %s; a decode step costs %.1f ms + %.2f ms a row",
        spec,
        cost.fixed_s * 1e3,
        cost.per_row_s * 1e3,
    )
    budget = DraftBudget(cost, config.max_running_requests, target.max_rows)
    return Speculator(drafter, config.max_running_requests, budget)


def _agreed(cost: StepCost, tp: TensorParallel, device: str) -> StepCost:
    """The ranks' mean step cost, the same on each: every rank's speculator trims its drafts
    by it, and the ranks must run the same batches (a draft model runs whole on each).
    `device`: the engine's, where its group's collectives run."""
    if tp.size == 1:
        return cost
    times = torch.tensor([cost.fixed_s, cost.per_row_s], dtype=torch.float64, device=device)
    fixed_s, per_row_s = (tp.all_reduce(times) / tp.size).tolist()
    return StepCost(fixed_s=fixed_s, per_row_s=per_row_s)
