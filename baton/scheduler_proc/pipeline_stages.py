"""Launching micro-batches on this rank's pipeline stage, and their outputs from the last one.

Every rank's scheduler launches the same micro-batches in the same order (the ranks' replicated
decisions, scheduler_proc/process.py). A stage before the last runs its layers and sends the
hidden states on (`BatchRunner.forward_stage`); the last stage samples and shares its outputs
with every rank, where a thread of their own receives them, one per micro-batch in launch order,
so that a stage computes its next micro-batch while the outputs of an earlier one are on their
way. A micro-batch's outputs reaching a rank mean every stage has finished it: the pages it used
may go back to the pool (deferred freeing holds across the stages).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import msgspec

from baton.distributed.pipeline_parallel import PipelineParallel
from baton.engine.batch.forward_batch import ForwardBatch, ForwardOutput
from baton.engine.engine import Engine


class PipelineStages:
    """Runs micro-batches on `engine`'s stage (on `engine_thread`, which does all its torch
    work) and yields each one's outputs as the last stage sampled them."""

    def __init__(self, engine: Engine, engine_thread: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.pp: PipelineParallel = engine.pp
        self._engine_thread = engine_thread
        self._receiver = (
            None
            if self.pp.is_last
            else ThreadPoolExecutor(1, thread_name_prefix="baton-stage-outputs")
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ForwardOutput)

    def launch(self, batch: ForwardBatch) -> Future[ForwardOutput]:
        """Start `batch` on this stage; its outputs, once the last stage has sampled them (or
        the error that stopped this stage's part of it)."""
        if self.pp.is_last:
            return self._engine_thread.submit(self._sample_and_share, batch)
        outputs: Future[ForwardOutput] = Future()
        stage = self._engine_thread.submit(self.engine.forward_stage, batch)
        received = self._receiver.submit(self._receive)
        stage.add_done_callback(lambda done: _fail_with(outputs, done))
        received.add_done_callback(lambda done: _settle(outputs, done))
        return outputs

    def _sample_and_share(self, batch: ForwardBatch) -> ForwardOutput:
        output = self.engine.forward(batch)
        source = self.pp.rank == self.pp.output_source
        self.pp.share_outputs(self._encoder.encode(output) if source else None)
        return output

    def _receive(self) -> ForwardOutput:
        return self._decoder.decode(self.pp.share_outputs(None))

    def shutdown(self) -> None:
        """Stop receiving (a receive under way is left to end with its group)."""
        if self._receiver is not None:
            self._receiver.shutdown(wait=False, cancel_futures=True)


def _settle(outputs: Future[ForwardOutput], done: Future[ForwardOutput]) -> None:
    """`outputs` takes `done`'s result or error, unless the stage failed first."""
    with contextlib.suppress(InvalidStateError):  # (it did)
        if done.exception() is not None:
            outputs.set_exception(done.exception())
        else:
            outputs.set_result(done.result())


def _fail_with(outputs: Future[ForwardOutput], stage: Future[None]) -> None:
    """`outputs` fails with the stage's error, if its part of the micro-batch failed."""
    if stage.exception() is not None:
        with contextlib.suppress(InvalidStateError):  # (the outputs came first)
            outputs.set_exception(stage.exception())
