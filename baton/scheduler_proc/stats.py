"""Per-request and aggregate statistics of the scheduler core."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable

from baton.hardware import ComputePlan, CpuCapabilities
from baton.process_messages import StepOutput, TokenLogprob
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_stats import AggregateStats, RequestStats


class StatsCollector:
    """Running totals, and the stats attached to each request's final output."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.finished_requests = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.preemptions = 0
        # Speculative decoding, of finished requests (running ones add theirs when asked).
        self.speculative_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def count_tokens(self, new_tokens: list[int]) -> None:
        """Account newly sampled tokens."""
        self.generated_tokens += len(new_tokens)

    def final_output(
        self, seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> StepOutput:
        """The last output of a finished sequence, with its stats."""
        self.finished_requests += 1
        self.prompt_tokens += seq.num_prompt_tokens
        self.cached_prompt_tokens += seq.num_cached_tokens
        self.speculative_steps += seq.num_speculative_steps
        self.draft_tokens += seq.num_draft_tokens
        self.accepted_tokens += seq.num_accepted_tokens
        times = seq.times
        end = times.finished or time.monotonic()
        first_token = times.first_token
        decode_time = end - first_token if first_token is not None else 0.0
        decoded = max(seq.num_output_tokens - 1, 0)
        stats = RequestStats(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            generated_tokens=seq.num_output_tokens,
            queue_time=(times.first_scheduled or end) - times.arrival,
            prompt_time=first_token - times.first_scheduled
            if first_token is not None and times.first_scheduled is not None
            else None,
            time_to_first_token=first_token - times.arrival if first_token is not None else None,
            decode_time=decode_time,
            e2e_latency=end - times.arrival,
            decode_tokens_per_s=decoded / decode_time if decode_time > 0 else 0.0,
            preemptions=seq.num_preemptions,
            spec_draft_tokens=seq.num_draft_tokens,
            spec_accepted_tokens=seq.num_accepted_tokens,
        )
        first_tokens = bool(new_tokens) and seq.num_output_tokens == len(new_tokens)
        return StepOutput(
            rid=seq.rid,
            new_token_ids=new_tokens,
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if first_tokens else None,
            finished=True,
            finish_reason=seq.finish_reason,
            stats=stats,
        )

    def aggregate(
        self,
        running: int,
        waiting: int,
        paused: int,
        live: Iterable[Sequence],
        kv: KVCacheManager,
        cpu: CpuCapabilities,
        compute_plan: ComputePlan,
    ) -> AggregateStats:
        """A snapshot of scheduler-wide state and totals (`live`: the unfinished requests),
        with the engine's machine and plan."""
        uptime = time.monotonic() - self.started
        live = [seq for seq in live if not seq.is_finished]
        return AggregateStats(
            running_requests=running,
            waiting_requests=waiting,
            paused_requests=paused,
            total_pages=kv.num_pages,
            free_pages=kv.allocator.num_free,
            cached_pages=kv.cache.num_cached_pages,
            used_pages=kv.used_pages,
            peak_used_pages=kv.peak_used_pages,
            # ru_maxrss is in KiB on Linux.
            peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            finished_requests=self.finished_requests,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            generated_tokens=self.generated_tokens,
            preemptions=self.preemptions,
            spec_decode_num_drafts=self.speculative_steps
            + sum(seq.num_speculative_steps for seq in live),
            spec_decode_num_draft_tokens=self.draft_tokens
            + sum(seq.num_draft_tokens for seq in live),
            spec_decode_num_accepted_tokens=self.accepted_tokens
            + sum(seq.num_accepted_tokens for seq in live),
            uptime=uptime,
            generation_throughput=self.generated_tokens / uptime if uptime > 0 else 0.0,
            cpu=cpu,
            compute_plan=compute_plan,
        )
