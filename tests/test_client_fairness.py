"""One client's flood through the launched server: another client's request is admitted after a
bounded number of the flood's, and the flood past its client's share of the queue is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers import free_port
from helpers.pipeline import wait_idle

from baton import SamplingParams
from baton.client import BatonClient, ServerError
from baton.config import BatonConfig
from baton.launch import Server

FLOOD = 16
# Long enough that a flood request still runs while the test sees the flood queued and sends the
# other client's request (a stats round trip, milliseconds).
FLOOD_PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
OTHER_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def connected(server: Server) -> BatonClient:
    client = BatonClient(server.addresses.requests, server.addresses.replies)
    await client.connect()
    return client


async def flood_then_other(server: Server) -> tuple[list[str], int, list[ServerError]]:
    """Client "flood" sends FLOOD requests at once; once they are queued, client "other" sends
    one. The order the requests finished in, how many had finished when "other" sent its
    request, and the flood's refusals."""
    flooder, other = await connected(server), await connected(server)
    finished: list[str] = []
    refused: list[ServerError] = []

    async def generate(client: BatonClient, name: str, params: SamplingParams) -> None:
        try:
            await client.generate([5, 6, 7, 8], params, request_id=name)
        except ServerError as error:
            refused.append(error)
            return
        finished.append(name)

    try:
        flood = [
            asyncio.create_task(generate(flooder, f"flood{index}", FLOOD_PARAMS))
            for index in range(FLOOD)
        ]
        while not await all_accounted_for(other, len(finished) + len(refused)):
            await asyncio.sleep(0.005)
        finished_before = len(finished)
        await asyncio.gather(generate(other, "other", OTHER_PARAMS), *flood)
        await wait_idle(other)
        return finished, finished_before, refused
    finally:
        await flooder.close()
        await other.close()


async def all_accounted_for(client: BatonClient, answered: int) -> bool:
    """Whether each flood request is running, waiting, or answered (finished or refused)."""
    stats = await client.stats()
    return stats.running_requests + stats.waiting_requests + answered >= FLOOD


def fairness_server(stories260k_dir: Path, **settings: int) -> Server:
    """One request runs at a time: the order requests finish in is the order they were admitted."""
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        max_running_requests=1,
        port=free_port(),
        log_level="warning",
        **settings,  # type: ignore[arg-type]
    )
    return Server(config)


def test_a_flood_delays_another_clients_request_by_a_bounded_number(stories260k_dir: Path) -> None:
    """First come, first served finished "other" last, after the whole flood; admitted in turn,
    it waits for the flood's running request and one more (give or take one that finished
    while it was on its way)."""
    with fairness_server(stories260k_dir) as server:
        finished, finished_before, refused = asyncio.run(flood_then_other(server))
    assert not refused and len(finished) == FLOOD + 1
    assert finished.index("other") <= finished_before + 3 < FLOOD


def test_a_flood_past_its_clients_share_is_refused_as_overloaded(stories260k_dir: Path) -> None:
    """Ten waiting requests a client: the flood's one running and ten waiting are served, the
    rest refused at once as overloaded (HTTP's 429), and the other client is served in turn."""
    with fairness_server(stories260k_dir, max_queued_requests_per_client=10) as server:
        finished, finished_before, refused = asyncio.run(flood_then_other(server))
    # The flood's first request may be admitted before or after the last ones arrive.
    assert FLOOD - 11 <= len(refused) <= FLOOD - 10
    assert {error.code for error in refused} == {"overloaded"}
    assert "this client" in refused[0].message
    assert len(finished) == FLOOD + 1 - len(refused)
    assert finished.index("other") <= finished_before + 3
