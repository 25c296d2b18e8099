"""Where the router hands each message: a request to the replica its balancer picks, an abort
or a pause to the replica running it, the rest to every replica."""

from __future__ import annotations

from baton.messages import Codec
from baton.process_messages import (
    AbortRid,
    ForwardedStatsRequest,
    PauseRid,
    ReplicaLoad,
    RequestStarted,
    SchedulerMessage,
    Shutdown,
    TokenizedRequest,
)
from baton.router_proc.process import Router
from baton.sampling_params import SamplingParams

CODEC: Codec = Codec(SchedulerMessage)


class Replica:
    """A socket that keeps what it was sent, decoded."""

    def __init__(self) -> None:
        self.received: list = []

    def send(self, frame: bytes) -> None:
        self.received.append(CODEC.decode_or_none(frame))


def request(rid: str) -> TokenizedRequest:
    started = RequestStarted(
        rid=rid,
        client_id=b"c",
        request_id=rid,
        prompt_tokens=3,
        prompt_tail=[1, 2, 3],
        stop=[],
        skip_special_tokens=True,
    )
    return TokenizedRequest(
        rid=rid,
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=4),
        arrival_time=0.0,
        started=started,
    )


def test_each_message_reaches_the_replicas_it_concerns() -> None:
    replicas = [Replica(), Replica()]
    router = Router(replicas, "round_robin")  # type: ignore[arg-type]
    for message in (request("a"), request("b"), AbortRid(rid="b"), PauseRid(rid="a", paused=True)):
        assert router.route(CODEC.encode(message))
    stats = ForwardedStatsRequest(client_id=b"c", request_id="s")
    assert router.route(CODEC.encode(stats))
    assert [type(m).__name__ for m in replicas[0].received] == [
        "TokenizedRequest",
        "PauseRid",
        "ForwardedStatsRequest",
    ]
    assert [type(m).__name__ for m in replicas[1].received] == [
        "TokenizedRequest",
        "AbortRid",
        "ForwardedStatsRequest",
    ]
    # Once a replica reports a request finished, the router forgets it: a late abort for it
    # goes to every replica (a replica ignores a rid it does not hold).
    router.reported(ReplicaLoad(replica=1, tokens=0, finished=["b"]))
    assert router.owners == {"a": 0}
    assert router.route(CODEC.encode(AbortRid(rid="b")))
    assert isinstance(replicas[0].received[-1], AbortRid)
    assert not router.route(CODEC.encode(Shutdown()))
    assert all(isinstance(replica.received[-1], Shutdown) for replica in replicas)
