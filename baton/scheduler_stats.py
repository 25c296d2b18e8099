"""The scheduler's figures as they travel: a request's (`RequestStats`, with its final output)
and the whole server's (`AggregateStats`, on request). Clients receive them in their replies
(`messages.py`); the scheduler computes them (`scheduler_proc/stats.py`)."""

from __future__ import annotations

import msgspec

from baton.hardware import ComputePlan, CpuCapabilities


class RequestStats(msgspec.Struct, kw_only=True):
    """Per-request figures, returned with the final output. Times in seconds."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    queue_time: float
    # From its first scheduling to its first token: the prefill, chunks and all.
    prompt_time: float | None
    time_to_first_token: float | None
    decode_time: float
    e2e_latency: float
    decode_tokens_per_s: float
    preemptions: int
    # Speculative decoding: drafts verified for it, and how many of them it accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class AggregateStats(msgspec.Struct, kw_only=True):
    """Scheduler-wide state and totals, on request."""

    running_requests: int  # paused ones included
    waiting_requests: int
    paused_requests: int
    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int  # held by requests: neither free nor merely cached
    peak_used_pages: int  # the most pages requests held at once
    # The scheduler process's peak resident memory: weights, KV pool, torch and the rest.
    peak_memory_bytes: int
    finished_requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    preemptions: int
    # Speculative decoding (vLLM's spec_decode counters): speculative steps, the drafts they
    # verified, and the drafts accepted.
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    uptime: float
    generation_throughput: float  # generated tokens per second of uptime
    # How long the scheduler has been waiting on the engine's current step: 0 between steps,
    # which is when stats are answered unless a step runs long (scheduler_proc/process.py).
    engine_step_seconds: float = 0.0
    # The machine and how the engine computes on it: every figure read off this server names them.
    cpu: CpuCapabilities
    compute_plan: ComputePlan
    # With several data-parallel replicas: which one answered (its index), and in a merged
    # reply every replica's own answer, by index (/metrics labels them `engine`, as vLLM does).
    replica: int = 0
    replicas: list[AggregateStats] = []


def merge_replica_stats(parts: list[AggregateStats]) -> AggregateStats:
    """The stats of a server of several data-parallel replicas, from each replica's: counts,
    pages, tokens and rates summed; uptime and the engine's current wait the longest; the CPU
    and the compute plan the first replica's (every replica runs on the same machine); each
    replica's own in `replicas`."""
    first = parts[0]
    summed = {
        name: sum(getattr(part, name) for part in parts)
        for name in first.__struct_fields__
        if name
        not in ("uptime", "engine_step_seconds", "cpu", "compute_plan", "replica", "replicas")
    }
    return msgspec.structs.replace(
        first,
        **summed,
        uptime=max(part.uptime for part in parts),
        engine_step_seconds=max(part.engine_step_seconds for part in parts),
        replica=0,
        replicas=sorted(parts, key=lambda part: part.replica),
    )
