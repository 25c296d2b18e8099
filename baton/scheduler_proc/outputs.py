"""What the scheduler core reports: per-step request outputs, per-request and aggregate stats.

msgspec Structs, so the scheduler process can send them over ZMQ unchanged.
"""

from __future__ import annotations

import msgspec

from baton.engine.compute_plan import ComputePlan, CpuCapabilities


class RequestStats(msgspec.Struct, kw_only=True):
    """Per-request figures, returned with the final output. Times in seconds."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    queue_time: float
    time_to_first_token: float | None
    decode_time: float
    e2e_latency: float
    decode_tokens_per_s: float
    preemptions: int


class TokenLogprob(msgspec.Struct, array_like=True):
    """The chosen token's log-probability and the top-n alternatives (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


class StepOutput(msgspec.Struct, kw_only=True):
    """New tokens of one request from one step; the last one carries finish reason and stats."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats | None = None
    # Prompt tokens served by the prefix cache, sent with the request's first tokens: a stop
    # string can end the request downstream before the final output (and its stats) exists.
    cached_tokens: int | None = None

    @property
    def ends_on_stop_token(self) -> bool:
        """The scheduler finished the request on its last token: EOS or a stop_token_id (stop
        strings are matched downstream, by the detokenizer)."""
        return self.finished and self.finish_reason == "stop"


class AggregateStats(msgspec.Struct, kw_only=True):
    """Scheduler-wide state and totals, on request."""

    running_requests: int
    waiting_requests: int
    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int  # held by requests: neither free nor merely cached
    finished_requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    preemptions: int
    uptime: float
    generation_throughput: float  # generated tokens per second of uptime
    # The machine and how the engine computes on it: every figure read off this server names them.
    cpu: CpuCapabilities
    compute_plan: ComputePlan
