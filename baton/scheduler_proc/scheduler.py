"""The transport-free scheduler core: continuous batching with an overlap loop and deferred freeing.

Overlap loop (mini-SGLang): each `step()` schedules and launches batch N+1 on the engine's worker
thread, then processes batch N's results while N+1 computes; so a sequence's results arrive one
step late and it may already sit in batch N+1 when N's results finish it.

Deferred freeing (request_queues.py): a finished, aborted or preempted sequence leaves `running`
at once, but its pages and slot are released only once no in-flight batch contains it. Tokens
computed for it after it finished are discarded.

Pipeline parallelism (pipeline_stages.py) deepens the same loop: `step()` keeps one micro-batch
in flight per stage, each stage computing a different one. A sequence's tokens handed to the
first stage are Vajra's *stage-processed* ones (`Sequence.num_stage_processed`), those whose
micro-batch has left the last stage its *step-processed* ones: only these are applied, checked
for stops and sent. A micro-batch's input tokens must be known when it is launched (its stages
cannot wait for a token still in the pipeline), so a sequence that samples sits in one
micro-batch at a time, while the chunks of a long prompt may fill several stages at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from baton.checkpoint.load import Checkpoint
from baton.config import BatonConfig
from baton.distributed.errors import DistributedError
from baton.distributed.process_group import Ranks
from baton.engine.batch.forward_batch import ForwardBatch, ForwardOutput
from baton.engine.batch.seeded_uniforms import seeded_uniforms
from baton.engine.engine import Engine
from baton.messages import FinishReason
from baton.process_messages import StepOutput
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.admission import Admission
from baton.scheduler_proc.batch_policy import BatchPolicy, ScheduledRow
from baton.scheduler_proc.batch_result import apply_results, build_forward_batch
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.pipeline_stages import PipelineStages
from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.request_queues import RequestQueues
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_stats import AggregateStats
from baton.validation import OverloadedError, RequestError

logger = logging.getLogger(__name__)


@dataclass
class InFlightBatch:
    """A launched batch whose results are not processed yet."""

    rows: list[ScheduledRow]
    result: Future[ForwardOutput]


class Scheduler(RequestQueues):
    """Admits requests, runs batches on the engine and reports per-step outputs.

    The engine lives on one dedicated thread, created here, that does all of its torch work (the
    weights' loading included), in both loop modes: torch ops issued from two threads make
    OpenMP keep two thread teams that spin against each other on the same cores, which measured
    here doubles the cost of a small model's step.
    """

    def __init__(
        self,
        config: BatonConfig,
        checkpoint: Checkpoint | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """`ranks`: this rank's place among its replica's (None: a single process)."""
        self.config = config
        self.overlap = not config.disable_overlap
        ranks = ranks or Ranks()
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="baton-engine")
        self.engine = self._engine_thread.submit(
            Engine, config, checkpoint, ranks.tp, ranks.pp
        ).result()
        engine = self.engine
        pipelined = ranks.pp.size > 1
        self._stages = PipelineStages(engine, self._engine_thread) if pipelined else None
        # Batches left in flight after a launch: one per pipeline stage but the one launched
        # into, else the overlap loop's one; and the steps one sequence may have in flight: one
        # per stage (a prompt's chunks), else two with the overlap loop (the second on a
        # placeholder token, which a pipeline cannot take).
        self._depth = ranks.pp.size - 1 if pipelined else int(self.overlap)
        self._max_in_flight = ranks.pp.size if pipelined else 1 + int(self.overlap)
        window = engine.checkpoint.config.uniform_window
        super().__init__(
            KVCacheManager(
                engine.num_pages, engine.page_size, config.enable_prefix_caching, window
            ),
            RequestOrder(config.scheduling_policy),
            config.max_running_requests,
            config.stream_interval,
        )
        self.policy = BatchPolicy(
            config,
            self.kv,
            self.order,
            self.running,
            self.waiting,
            self.free_slots,
            self._preempt,
            engine.max_model_len,
        )
        self._in_flight: deque[InFlightBatch] = deque()
        self._notices: list[StepOutput] = []
        self.admission = Admission(config, engine, self.kv)

    # --- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline_ms: float | None = None,
        reasoning_end_token: int | None = None,
        client: bytes = b"",
    ) -> None:
        """Queue a request of `client` validated by `baton.validation` (the tokenizer process,
        or `LLM`); RequestError (typed) where it cannot be taken now: a duplicate id, one this
        server can never run (`Admission.check`), a full queue (`queue_refusal`). A reply that
        opens in the model's reasoning names the token that ends it: its constraint, if any,
        starts after that token."""
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        max_tokens = self.admission.check(len(prompt_ids), params)
        refusal = self.queue_refusal(client)
        if refusal is not None:
            raise OverloadedError(refusal)
        grammar = self.admission.grammar(params, reasoning_end_token)
        seq = Sequence(
            rid,
            prompt_ids,
            params,
            max_tokens,
            self.kv.page_size,
            max_in_flight=self._max_in_flight,
            on_placeholders=self._stages is None,
            generator=seeded_uniforms(params.seed, self.engine.device),
            arrival_time=arrival_time,
            priority=priority,
            deadline_ms=deadline_ms,
            grammar=grammar,
            client=client,
        )
        self.requests[rid] = seq
        self.waiting.insert(seq)

    def queue_refusal(self, client: bytes = b"") -> str | None:
        """Why a new request of `client` would be refused as overloaded now: the waiting queue
        is full (--max-waiting-requests), or this client's share of it is
        (--max-queued-requests-per-client); None if it would be queued."""
        if len(self.waiting) >= self.config.max_waiting_requests:
            return f"{len(self.waiting)} requests waiting; retry later"
        queued = self.waiting.count(client)
        if queued >= self.config.max_queued_requests_per_client:
            return (
                f"{queued} requests of this client waiting, the most one client may queue; "
                "retry later"
            )
        return None

    def abort_request(self, rid: str, reason: FinishReason = "abort") -> None:
        """Finish a request early (client abort, or a stop string found downstream).

        Its final output (no new tokens) comes with the next `step()`; unknown ids are ignored,
        since a request may finish on its own while the abort is on its way.
        """
        seq = self.requests.get(rid)
        if seq is None or seq.is_finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._held.drop(rid)
        self._notices.append(self._finish(seq, reason))
        self._release_ready()

    def has_runnable_work(self) -> bool:
        """Whether `step()` could do anything now: a batch in flight, outputs or releases
        pending, or a request that is not paused (the server loop blocks otherwise)."""
        pending = self._in_flight or self._notices or self.releasing
        return bool(pending) or len(self.requests) > self._num_paused

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._notices)

    # --- the loop ------------------------------------------------------------------------------
    def step(self, wait: Callable[[Future[ForwardOutput]], None] | None = None) -> list[StepOutput]:
        """Schedule and launch the next batch, then process the previous one's results.

        `wait`, if given, is called with an engine result not ready yet before blocking on it:
        the server answers stats requests there; it may read the scheduler, never change it.
        """
        outputs, self._notices = self._notices, []
        rows = self.policy.next_batch()
        if rows:
            self._launch(rows)
        # With nothing to launch, the oldest batch's results: they free its sequences to run.
        keep_in_flight = self._depth if rows else max(0, len(self._in_flight) - 1)
        while len(self._in_flight) > keep_in_flight:
            flight = self._in_flight.popleft()
            if wait is not None and not flight.result.done():
                wait(flight.result)
            outputs.extend(self._process(flight))
        self._release_ready()
        return outputs

    def _launch(self, rows: list[ScheduledRow]) -> None:
        batch = build_forward_batch(
            rows, self.engine.checkpoint.eos_token_ids, self.engine.speculator is not None
        )
        for row in rows:
            row.seq.enter_batch()
        if self._stages is not None:
            result = self._stages.launch(batch)
        elif self.order.changes_as_requests_run:  # lrs: remaining times from measured costs
            prefill_tokens = sum(row.step.num_tokens for row in rows if row.step.is_prefill)
            result = self._engine_thread.submit(self._measured_forward, batch, prefill_tokens)
        else:
            result = self._engine_thread.submit(self.engine.forward, batch)
        self._in_flight.append(InFlightBatch(rows, result))

    def _measured_forward(self, batch: ForwardBatch, prefill_tokens: int) -> ForwardOutput:
        """The forward, its time folded into the policy's costs (on the engine thread: the
        scheduler thread only reads them, two floats)."""
        started = time.perf_counter()
        output = self.engine.forward(batch)
        self.order.costs.observe(prefill_tokens, time.perf_counter() - started)
        return output

    def _process(self, flight: InFlightBatch) -> list[StepOutput]:
        for row in flight.rows:
            row.seq.leave_batch()
        try:
            output = flight.result.result()
        except Exception as error:
            if self._stages is not None:
                # The stages part ways: each holds K/V the others' next micro-batches assume.
                raise DistributedError(
                    f"stage {self.engine.pp.stage}: a micro-batch failed: {error}"
                ) from error
            logger.exception(
                "forward failed; failing the %d requests of its batch", len(flight.rows)
            )
            return [
                self._finish(row.seq, "error") for row in flight.rows if not row.seq.is_finished
            ]
        results = apply_results(flight.rows, output, self.kv, self.engine.checkpoint.eos_token_ids)
        outputs = []
        for seq, new_tokens, logprobs, finish_reason in results:
            self.stats.count_tokens(new_tokens)
            if finish_reason is not None:
                outputs.append(self._finish(seq, finish_reason, new_tokens, logprobs))
            elif new_tokens:
                first_tokens = seq.num_output_tokens == len(new_tokens)
                if not first_tokens and self._held.interval > 1:
                    due = self._held.add(seq.rid, new_tokens, logprobs)
                    if due is None:
                        continue
                    new_tokens, logprobs = due
                outputs.append(
                    StepOutput(
                        rid=seq.rid,
                        new_token_ids=new_tokens,
                        logprobs=logprobs,
                        cached_tokens=seq.num_cached_tokens if first_tokens else None,
                        prompt_logprobs=seq.prompt_logprobs if first_tokens else None,
                    )
                )
        return outputs

    # --- stats -------------------------------------------------------------------------------
    def held_tokens(self) -> int:
        """The tokens of every request, running or waiting: a data-parallel replica's load as
        the router's shortest_queue weighs it."""
        return sum(seq.total_tokens for seq in self.requests.values())

    def aggregate_stats(self) -> AggregateStats:
        engine = self.engine
        return self.stats.aggregate(
            len(self.running),
            len(self.waiting),
            self._num_paused,
            self.requests.values(),
            self.kv,
            engine.cpu,
            engine.plan,
        )

    def shutdown(self) -> None:
        """Stop the engine thread once the batch it computes is done."""
        if self._stages is not None:
            self._stages.shutdown()
        self._engine_thread.shutdown(wait=True, cancel_futures=True)
