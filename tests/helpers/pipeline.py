"""A live server's pipeline from a test: a connected client, requests all at once, waiting for
it to go idle."""

from __future__ import annotations

import asyncio
import contextlib

from baton.client import BatonClient
from baton.launch import Server
from baton.sampling_params import SamplingParams
from baton.scheduler_stats import AggregateStats


async def wait_idle(client: BatonClient, timeout: float = 10.0) -> AggregateStats:
    """Aggregate stats once nothing runs and every page is free or merely cached (or, after
    `timeout` seconds, as they are then)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await client.stats()
        idle = stats.running_requests == stats.waiting_requests == stats.used_pages == 0
        if idle or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def connected(server: Server) -> BatonClient:
    """A ZMQ client of a running `Server`, connected."""
    client = BatonClient(server.addresses.requests, server.addresses.replies)
    await client.connect()
    return client


def generate_all(server: Server, prompts: list, params: SamplingParams) -> list:
    """Every prompt's result from one client, the requests all open at once."""
    return generate_all_until_idle(server, prompts, params)[0]


def generate_all_until_idle(
    server: Server, prompts: list, params: SamplingParams
) -> tuple[list, AggregateStats]:
    """`generate_all`'s results, and the stats once the pipeline is idle after them."""

    async def main():
        client = await connected(server)
        try:
            results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            return results, await wait_idle(client)
        finally:
            await client.close()

    return asyncio.run(main())


def abort_beside_a_survivor(
    server: Server, aborted: str, survivor: str, params: SamplingParams
) -> tuple:
    """A request for `survivor` runs while one for `aborted` streams 5 tokens and is dropped
    (closing the stream aborts it server-side): the survivor's result, and the stats once the
    pipeline is idle."""

    async def main():
        client = await connected(server)
        try:
            kept = asyncio.create_task(client.generate(survivor, params))
            received = 0
            async with contextlib.aclosing(client.stream(aborted, params)) as stream:
                async for delta in stream:
                    received += len(delta.token_ids)
                    if received >= 5:
                        break
            return await kept, await wait_idle(client)
        finally:
            await client.close()

    return asyncio.run(main())
