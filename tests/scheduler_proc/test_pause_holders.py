"""A request's two pause holds, its client's and the server's: each lifts only its own."""

from __future__ import annotations

from baton.sampling_params import SamplingParams
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_state import EventKind, SequenceStatus

PAGE = 4


def test_neither_holder_resumes_what_the_other_paused() -> None:
    """The server pauses a request whose client's replies wait unread; the client's own resume
    (a raw client may send one without reading) does not lift that, nor does the server's
    resume lift the client's pause of a reader still behind. Only the last hold's lifting
    resumes it."""
    kv = KVCacheManager(16, PAGE, enable_prefix_caching=True)
    seq = Sequence("r", list(range(1, 9)), SamplingParams(), 10, PAGE)
    seq.match_and_add_prefix(kv)
    seq.admit(0, seq.schedule_prefill(8, kv))
    seq.apply_prefill(100)
    assert seq.status is SequenceStatus.RUNNING

    assert seq.set_paused(True, "server")
    assert not seq.set_paused(False, "client")  # the client holds nothing to lift
    assert seq.paused and seq.status is SequenceStatus.PAUSED
    assert not seq.set_paused(True, "client")  # paused already: a second hold
    assert not seq.set_paused(False, "server")
    assert seq.paused and seq.status is SequenceStatus.PAUSED  # the client's hold stays
    assert seq.set_paused(False, "client")
    assert not seq.paused and seq.status is SequenceStatus.RUNNING
    kinds = [event.kind for event in seq.history]
    assert kinds.count(EventKind.PAUSED) == kinds.count(EventKind.RESUMED) == 1
