"""Building an engine's speculator from `--speculative-config`: the drafter, and the draft budget
with this machine's measured step cost."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from baton.config import BatonConfig
from baton.engine.speculation.draft_budget import DraftBudget, StepCost
from baton.engine.speculation.draft_model import DraftModel
from baton.engine.speculation.drafter import Drafter, NgramDrafter
from baton.engine.speculation.speculator import Speculator
from baton.engine.startup_timing import idle_decode_step

if TYPE_CHECKING:  # the engine builds its speculator: a type only, no import cycle
    from baton.engine.engine import Engine

logger = logging.getLogger(__name__)

# Rows of the larger step timed at start-up (with one row: the fixed and the per-row cost).
_TIMED_ROWS = 16


def make_speculator(config: BatonConfig, engine: Engine) -> Speculator | None:
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
            spec, config, engine.vocab_size, engine.num_pages, engine.dtype, engine.gemm_dtype
        )
    many_rows = min(_TIMED_ROWS, engine.num_pages * engine.page_size)
    cost = StepCost.measure(lambda rows: idle_decode_step(engine, rows), many_rows)
    logger.info(
        "speculative decoding: %s; a decode step costs %.1f ms + %.2f ms a row",
        spec,
        cost.fixed_s * 1e3,
        cost.per_row_s * 1e3,
    )
    # On a CPU's float32 plan, rows past the compact weights' would leave the native step for
    # float32 GEMMs, which are compute-bound: a hard cap. With bf16 GEMMs (ComputePlan.gemm_dtype)
    # the rows past the crossover take the path start-up timed as the faster one: no cap.
    capped = engine.device.type == "cpu" and engine.plan.gemm_dtype is None
    max_rows = engine.model.compact_max_rows if capped else None
    budget = DraftBudget(cost, config.max_running_requests, max_rows)
    return Speculator(drafter, config.max_running_requests, budget)
