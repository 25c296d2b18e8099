"""Merging a request's choice streams: closing the merge closes every choice's stream at once."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

from baton.frontend.generation import merged_streams
from baton.messages import GenerateDelta


def test_closing_the_merge_closes_every_stream_even_those_waiting_for_the_reader() -> None:
    closed: set[int] = set()

    async def endless(index: int) -> AsyncIterator[GenerateDelta]:
        try:
            while True:
                yield GenerateDelta(request_id=str(index), token_ids=[index], text="")
                await asyncio.sleep(0)
        finally:
            closed.add(index)

    async def read_one_then_close() -> None:
        streams = {index: endless(index) for index in range(8)}
        merged = merged_streams(streams)
        await anext(merged)
        # Let every pump fill the bounded queue: most now wait for room, outside their
        # stream, as behind a client that stopped reading.
        for _ in range(20):
            await asyncio.sleep(0)
        await merged.aclose()
        # `streams` still holds every stream: only an explicit close ends them, and the
        # collector must not be what does it.
        assert closed == set(range(8))
        del streams

    gc.disable()
    try:
        asyncio.run(read_one_then_close())
    finally:
        gc.enable()
