"""The launched server end to end, through the ZMQ client: outputs, aborts, pressure, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import free_port
from helpers.pipeline import wait_idle

from baton import LLM, SamplingParams
from baton.chat_options import ChatOptions
from baton.client import BatonClient, ServerError
from baton.config import BatonConfig
from baton.launch import Server
from baton.messages import ChatMessage, ClientReply, Codec, ErrorReply, Hello, HelloAck
from baton.structured_outputs import StructuredOutputsParams

STORY_PROMPTS = ["The little dog", "One day, a girl named Sue", "Lily and Tom went to the park"]


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "plain"])
def server(request: pytest.FixtureRequest, stories260k_dir: Path) -> Iterator[Server]:
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=400,
        disable_overlap=request.param,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


@pytest.fixture(scope="module")
def offline(stories260k_dir: Path) -> LLM:
    return LLM(str(stories260k_dir), dtype="float32")


def run(coroutine):
    return asyncio.run(coroutine)


async def connected(server: Server) -> BatonClient:
    client = BatonClient(server.addresses.requests, server.addresses.replies)
    await client.connect()
    return client


def test_greedy_outputs_equal_offline_llm(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200)
    expected = offline.generate(STORY_PROMPTS, params)

    async def main():
        client = await connected(server)
        try:
            return await asyncio.gather(*(client.generate(p, params) for p in STORY_PROMPTS))
        finally:
            await client.close()

    results = run(main())
    for result, reference in zip(results, expected):
        assert result.token_ids == reference.token_ids
        assert result.text == reference.text
        assert result.finish_reason == reference.finish_reason
        assert result.usage.completion_tokens == len(reference.token_ids)
        assert result.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_structured_outputs_reach_the_engine(server: Server, offline: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=regex(r"[A-Z][a-z]+ (is|was) [a-z]+\.")
    )
    expected = offline.generate(STORY_PROMPTS, params)

    async def main():
        client = await connected(server)
        try:
            return await asyncio.gather(*(client.generate(p, params) for p in STORY_PROMPTS))
        finally:
            await client.close()

    for result, reference in zip(run(main()), expected):
        assert result.text == reference.text and result.finish_reason == "stop"


def test_prompt_logprobs_reach_a_zmq_client(server: Server, offline: LLM) -> None:
    """The scored prompt's tokens, with texts, in the result of `generate`."""
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    expected = offline.generate(STORY_PROMPTS[0], params)[0]

    async def main():
        client = await connected(server)
        try:
            return await client.generate(STORY_PROMPTS[0], params)
        finally:
            await client.close()

    result = run(main())
    scored = result.prompt_logprobs
    assert scored.first_token == "<s>"
    assert "".join(entry.token.text for entry in scored.entries) == " " + STORY_PROMPTS[0]
    assert [entry.token.logprob for entry in scored.entries] == pytest.approx(
        [entry.logprob for entry in expected.prompt_logprobs], abs=1e-4
    )
    assert [len(entry.top) for entry in scored.entries] == [1] * len(scored.entries)
    assert result.token_ids == expected.token_ids


def test_stream_abort_frees_pages_and_spares_others(server: Server, offline: LLM) -> None:
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    expected = offline.generate(STORY_PROMPTS[1], long)[0]

    async def main():
        client = await connected(server)
        try:
            survivor = asyncio.create_task(client.generate(STORY_PROMPTS[1], long))
            received = 0
            async with contextlib.aclosing(client.stream(STORY_PROMPTS[0], long)) as stream:
                async for delta in stream:
                    received += len(delta.token_ids)
                    if received >= 5:
                        break  # closing the stream aborts the request server-side
            cancelled = asyncio.create_task(client.generate(STORY_PROMPTS[2], long))
            await asyncio.sleep(0.2)
            cancelled.cancel()  # cancelling a generate task aborts too
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            return await survivor, await wait_idle(client)
        finally:
            await client.close()

    survivor, stats = run(main())
    assert survivor.token_ids == expected.token_ids
    assert stats.used_pages == 0 and stats.running_requests == 0
    assert stats.free_pages + stats.cached_pages == stats.total_pages


def test_failing_open_requests_aborts_them_on_the_server(server: Server) -> None:
    """What the frontend does to requests still open when its shutdown drain times out."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        client = await connected(server)
        try:
            before = await wait_idle(client)
            with pytest.raises(ServerError, match="unavailable: shutting down"):
                async for delta in client.stream("Once upon a time", params):
                    if delta.token_ids:
                        assert client.fail_open_requests("unavailable", "shutting down") == 1
            return before, await wait_idle(client)
        finally:
            await client.close()

    before, after = run(main())
    # Aborted: far fewer than the 400 tokens it would have run to.
    assert after.generated_tokens - before.generated_tokens < 400
    assert after.used_pages == 0 and after.running_requests == 0


def test_a_stream_opens_with_the_requests_admission(server: Server) -> None:
    """The first delta carries nothing: the scheduler took the request (the frontend starts
    an HTTP stream on it); the rest carry the tokens."""

    async def main():
        client = await connected(server)
        try:
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            return [delta async for delta in client.stream("Once upon a time", params)]
        finally:
            await client.close()

    admitted, *deltas = run(main())
    assert admitted.admission and admitted.token_ids == [] and admitted.text == ""
    assert not any(delta.admission for delta in deltas)
    assert sum(len(delta.token_ids) for delta in deltas) == 3 and deltas[-1].finished


def test_explicit_abort_reports_abort(server: Server) -> None:
    async def main():
        client = await connected(server)
        try:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            task = asyncio.create_task(client.generate("Once upon a time", params, request_id="r1"))
            await asyncio.sleep(0.3)
            await client.abort("r1")
            return await task
        finally:
            await client.close()

    result = run(main())
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 400


def test_a_duplicate_request_id_is_refused_and_the_first_request_goes_on(server: Server) -> None:
    """Once the duplicate took the first request's reply queue: the first hung forever."""

    async def main():
        client = await connected(server)
        try:
            # Long enough to be still running when the duplicate comes (40 tokens once were not,
            # on a faster pipeline: the "duplicate" then was a new request).
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            first = asyncio.create_task(client.generate("Once upon a time", params, "dup"))
            await asyncio.sleep(0.1)
            assert not first.done()
            with pytest.raises(ServerError) as raised:
                await client.generate("Another", params, request_id="dup")
            return raised.value.code, await asyncio.wait_for(first, 60)
        finally:
            await client.close()

    code, first = run(main())
    assert code == "invalid_request"
    assert first.finish_reason == "length" and len(first.token_ids) == 400


def test_hundred_concurrent_requests_under_kv_pressure(stories260k_dir: Path, offline: LLM) -> None:
    rng = random.Random(5)
    prompts = [
        [1, *(rng.randrange(3, 512) for _ in range(rng.randrange(8, 40)))] for _ in range(100)
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    # 60 pages of 4 tokens: a few requests at a time; the rest wait or get preempted.
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=60,
        max_model_len=240,  # the longest request the pool can hold
        port=free_port(),
        log_level="warning",
    )

    async def main(server: Server):
        client = await connected(server)
        try:
            results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            return results, await wait_idle(client)
        finally:
            await client.close()

    with Server(config) as server:
        results, stats = run(main(server))
    assert [r.token_ids for r in results] == expected
    assert stats.used_pages == 0 and stats.free_pages + stats.cached_pages == 60
    assert stats.preemptions > 0


def test_stop_string_across_tokens_never_leaks(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200)
    full = offline.generate(STORY_PROMPTS[0], params)[0].text
    stop = full[20:32]  # spans several tokens of the SentencePiece vocabulary
    stopped = SamplingParams(temperature=0, max_tokens=200, stop=[stop])

    async def main():
        client = await connected(server)
        try:
            deltas = []
            async with contextlib.aclosing(client.stream(STORY_PROMPTS[0], stopped)) as stream:
                async for delta in stream:
                    deltas.append(delta)
            return deltas
        finally:
            await client.close()

    deltas = run(main())
    text = "".join(d.text for d in deltas)
    assert text == full[: full.index(stop)]
    stopped.include_stop_str_in_output = True  # vLLM's: the stop string ends the text
    kept = "".join(d.text for d in run(main()))
    assert kept == full[: full.index(stop) + len(stop)]
    assert deltas[-1].finish_reason == "stop"
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        assert full.startswith(emitted)  # nothing emitted is ever taken back


def test_min_tokens_holds_back_stop_strings_through_the_pipeline(
    server: Server, offline: LLM
) -> None:
    """{"min_tokens": 5, "stop": [X]} once ended at X's first occurrence even inside the first 5
    tokens; as in vLLM, only an occurrence completed from the 5th token on stops it now."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    first = offline.generate(STORY_PROMPTS[0], params)[0]
    stop = first.text.strip()[0]  # the first generated character: inside the first token
    held = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop], min_tokens=5)

    async def main():
        client = await connected(server)
        try:
            return await client.generate(STORY_PROMPTS[0], held)
        finally:
            await client.close()

    result = run(main())
    expected = offline.generate(STORY_PROMPTS[0], held)[0]
    assert result.text == expected.text and len(result.token_ids) >= 5
    assert first.text.startswith(result.text) and len(result.text) > len(first.text.split(stop)[0])


def test_a_stop_string_finish_reports_the_prefix_cache_hit(server: Server, offline: LLM) -> None:
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play outside."
    full = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=60))[0].text
    stopped = SamplingParams(temperature=0, max_tokens=60, stop=[full[10:20]])

    async def main():
        client = await connected(server)
        try:
            await client.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # cache it
            return await client.generate(prompt, stopped)
        finally:
            await client.close()

    result = run(main())
    assert result.finish_reason == "stop" and result.text == full[:10]
    # The stop string ends the request before the scheduler's final stats: the hit count comes
    # with the first tokens instead (whole 4-token pages of the prompt).
    assert result.usage is not None
    assert result.usage.cached_tokens > 0 and result.usage.cached_tokens % 4 == 0


def test_bad_input_gets_typed_errors_and_server_keeps_serving(server: Server) -> None:
    async def main():
        client = await connected(server)
        errors = {}
        try:
            for name, prompt, params in [
                ("too_long", [1] * 600, SamplingParams(max_tokens=4)),
                ("negative_max_tokens", "hi", SamplingParams(max_tokens=-1)),
                ("bad_token", [1, 10**6], SamplingParams()),
                ("bad_temperature", "hi", SamplingParams(temperature=-3)),
                # Malformed (the tokenizer process's check), and beyond this vocabulary (the
                # scheduler's, which compiles it against the tokenizer).
                ("bad_regex", "hi", SamplingParams(structured_outputs=regex("[a-"))),
                ("bad_token_grammar", "hi", SamplingParams(structured_outputs=lark("<[9999]>"))),
            ]:
                with pytest.raises(ServerError) as raised:
                    await client.generate(prompt, params)
                errors[name] = raised.value.code
            # A priority under fcfs, and chat options that contradict each other: refused as
            # over HTTP, by the same checks in the tokenizer process.
            with pytest.raises(ServerError, match="Priority scheduling is not enabled") as raised:
                await client.generate("hi", SamplingParams(max_tokens=2), priority=5)
            errors["priority"] = raised.value.code
            contradicting = ChatOptions(continue_final_message=True)
            with pytest.raises(ServerError, match="Cannot set both") as raised:
                await client.generate([ChatMessage("user", "hi")], chat=contradicting)
            errors["chat"] = raised.value.code
            errors["raw"] = await raw_frames(server, client.client_id)
            ok = await client.generate("Once", SamplingParams(max_tokens=3, ignore_eos=True))
            return errors, ok
        finally:
            await client.close()

    errors, ok = run(main())
    assert errors["too_long"] == "prompt_too_long"
    assert errors["negative_max_tokens"] == errors["bad_token"] == "invalid_request"
    assert errors["bad_temperature"] == errors["priority"] == errors["chat"] == "invalid_request"
    assert errors["bad_regex"] == errors["bad_token_grammar"] == "invalid_request"
    assert errors["raw"] == ["invalid_request"] * 4
    assert len(ok.token_ids) == 3


def regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=pattern)


def lark(grammar: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=f"start: {grammar}")


async def raw_frames(server: Server, client_id: bytes) -> list[str]:
    """Send hand-made bad frames from a second raw client; collect the error codes."""
    context = zmq.asyncio.Context.instance()
    requests, replies = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    raw_id = client_id[::-1]
    for socket, address in (
        (requests, server.addresses.requests),
        (replies, server.addresses.replies),
    ):
        socket.setsockopt(zmq.ROUTING_ID, raw_id)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
    codec = Codec(ClientReply)
    await replies.send(msgspec.msgpack.encode(Hello()))
    await replies.recv()
    frames = [
        b"\xc1 not msgpack",
        b"\x81\xa4type\xa3\xed\xa0\x80",  # invalid UTF-8: UnicodeDecodeError in msgspec
        msgspec.msgpack.encode({"type": "generate", "request_id": "w", "prompt": 5}),
        msgspec.msgpack.encode(
            {"type": "generate", "request_id": "x", "params": {"temperature": "hot"}}
        ),
    ]
    codes = []
    for frame in frames:
        await requests.send(frame)
        reply = codec.decode_or_none(await asyncio.wait_for(replies.recv(), 10))
        (item,) = reply.items
        assert isinstance(item, ErrorReply) and item.message
        codes.append(item.code)
    requests.close()
    replies.close()
    return codes


def test_a_reader_that_falls_behind_pauses_its_request(server: Server, offline: LLM) -> None:
    """Backpressure: a stream nobody reads is paused on the server once PAUSE_AT_UNREAD deltas
    wait (its pages kept, nothing computed), resumed when read, and ends with the tokens it
    would have had anyway."""
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    expected = offline.generate(STORY_PROMPTS[0], params)[0].token_ids

    async def main():
        client = await connected(server)
        try:
            stream = client.stream(STORY_PROMPTS[0], params)
            assert (await anext(stream)).admission
            token_ids = list((await anext(stream)).token_ids)  # then stop reading
            paused = None
            for _ in range(200):  # up to 10 s for the server to pause it
                await asyncio.sleep(0.05)
                stats = await client.stats()
                if stats.paused_requests:
                    paused = stats
                    break
            async for delta in stream:
                token_ids.extend(delta.token_ids)
            return paused, token_ids, await client.stats()
        finally:
            await client.close()

    paused, token_ids, after = run(main())
    assert paused is not None and paused.paused_requests == 1
    assert paused.used_pages > 0  # it kept its pages while paused
    assert token_ids == expected
    assert after.paused_requests == 0 and after.running_requests == 0


def test_a_vanished_client_whose_requests_are_all_paused_is_found_by_the_heartbeat(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that stopped reading (its requests paused, so no reply goes to it) and then
    vanished: the heartbeat's send finds it gone, and its requests are aborted, their pages
    freed (they once stayed until a reply was sent to it, which never came). Its streams,
    closed after it, send nothing (they once sent aborts on its closed socket)."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        observer, client = await connected(server), await connected(server)
        try:
            streams = [client.stream(prompt, params) for prompt in STORY_PROMPTS]
            for stream in streams:
                assert (await anext(stream)).admission  # then stop reading
            for _ in range(200):  # up to 10 s for the server to pause them
                await asyncio.sleep(0.05)
                if (await observer.stats()).paused_requests == len(streams):
                    break
            else:
                raise AssertionError("the unread requests were never all paused")
            await client.close()  # gone, without an abort: its streams are left open
            return await wait_idle(observer)
        finally:
            await observer.close()

    after = run(main())  # which closes the streams left open, as the loop shuts down
    gc.collect()
    assert after.used_pages == 0 and after.running_requests == after.paused_requests == 0
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


def test_open_requests_fail_when_the_server_falls_silent() -> None:
    """A server that died or stopped sends no heartbeat: the client's open requests end with
    a typed error instead of waiting forever. Here the "server" answers the handshake only."""
    context = zmq.asyncio.Context()
    requests, replies = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    requests_port, replies_port = free_port(), free_port()
    requests.bind(f"tcp://127.0.0.1:{requests_port}")
    replies.bind(f"tcp://127.0.0.1:{replies_port}")
    codec: Codec[ClientReply] = Codec(ClientReply)

    async def main() -> float:
        client = BatonClient(
            f"tcp://127.0.0.1:{requests_port}",
            f"tcp://127.0.0.1:{replies_port}",
            server_silence_s=1.0,
        )

        async def handshake() -> None:
            client_id, _ = await replies.recv_multipart()
            await replies.send_multipart([client_id, codec.encode(HelloAck())])

        await asyncio.gather(client.connect(), handshake())
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(ServerError, match="unavailable: the server has not answered"):
                await asyncio.wait_for(client.generate("Hi", SamplingParams(max_tokens=4)), 10)
        finally:
            await client.close()
        return asyncio.get_running_loop().time() - started

    try:
        assert run(main()) < 5
    finally:
        requests.close(linger=0)
        replies.close(linger=0)
        context.term()
