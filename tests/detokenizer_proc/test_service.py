"""The detokenizer's socket-free service: deltas, stop strings, failures and vanished clients."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec
from helpers import SAMPLE_STATS
from helpers.detokenizer import (
    CLIENT_A,
    CLIENT_B,
    encode,
    request_started,
    request_stats,
    step_output,
)

from baton.checkpoint.tokenizer import Tokenizer
from baton.detokenizer_proc.incremental import REPLACEMENT_CHAR
from baton.detokenizer_proc.service import DetokenizerService, Handled
from baton.messages import ErrorReply, GenerateDelta, LogprobEntry, StatsReply, TokenText
from baton.process_messages import (
    AbortRid,
    ForwardedStats,
    RequestFailed,
    SchedulerOutputs,
    Shutdown,
    StepOutput,
    TokenLogprob,
    make_rid,
)


def _deltas(handled: Handled, client_id: bytes) -> list[GenerateDelta]:
    items = handled.replies.get(client_id, [])
    assert all(isinstance(item, GenerateDelta) for item in items)
    return items  # type: ignore[return-value]


def _stream(
    service: DetokenizerService, client_id: bytes, request_id: str, chunks: Sequence[list[int]]
) -> list[GenerateDelta]:
    """Feed `chunks` as one request's steps (the last one finishing by length)."""
    deltas = []
    for index, chunk in enumerate(chunks):
        reason = "length" if index == len(chunks) - 1 else None
        outputs = SchedulerOutputs(steps=[step_output(client_id, request_id, chunk, reason)])
        deltas += _deltas(service.handle_message(outputs), client_id)
    return deltas


def test_token_deltas_give_the_text_and_a_final_delta_with_usage(
    tokenizer: Tokenizer,
) -> None:
    service = DetokenizerService(tokenizer)
    prompt = encode(tokenizer, "Say hi:")
    generated = encode(tokenizer, " hello there")
    service.handle_message(SchedulerOutputs(started=[request_started(CLIENT_A, "r1", prompt)]))
    logprobs = [TokenLogprob(logprob=-0.5, top=[(generated[0], -0.5)])]
    first = StepOutput(rid=make_rid(CLIENT_A, "r1"), new_token_ids=generated[:1], logprobs=logprobs)
    deltas = _deltas(service.handle_message(SchedulerOutputs(steps=[first])), CLIENT_A)
    chunks = [generated[1:4], generated[4:]]
    deltas += _stream(service, CLIENT_A, "r1", chunks)

    assert "".join(delta.text for delta in deltas) == tokenizer.decode(generated)
    # The detokenizer spells out the logprob tokens: " h" is the first token's text here.
    token = TokenText(token_id=generated[0], text=" ", bytes=[32], logprob=-0.5)
    assert deltas[0].logprobs == [LogprobEntry(token=token, top=[token])]
    assert [delta.token_ids for delta in deltas] == [generated[:1], *chunks]
    assert [delta.finished for delta in deltas] == [False, False, True]
    final = deltas[-1]
    assert final.request_id == "r1"
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        len(prompt),
        len(generated),
    )
    assert final.usage.cached_tokens == 4
    assert final.stats == request_stats(cached_tokens=4)
    assert service.active_rids == set()


def test_real_text_with_stories260k(stories260k_dir: Path) -> None:
    stories = Tokenizer.from_folder(stories260k_dir)
    service = DetokenizerService(stories)
    prompt = stories.encode("Once upon a time")
    generated = encode(stories, "there was a little girl named Lily.")
    service.handle_message(SchedulerOutputs(started=[request_started(CLIENT_A, "r1", prompt)]))
    deltas = _stream(service, CLIENT_A, "r1", [[token] for token in generated])
    # The text generated tokens add to the prompt (keeping the first word's leading space).
    full = stories.decode(prompt + generated, skip_special_tokens=True)
    expected = full[len(stories.decode(prompt, skip_special_tokens=True)) :]
    assert "".join(delta.text for delta in deltas) == expected
    assert "little girl" in expected


def test_stop_string_across_steps_ends_the_request_and_aborts_it(
    tokenizer: Tokenizer,
) -> None:
    service = DetokenizerService(tokenizer)
    started = request_started(CLIENT_A, "r1", encode(tokenizer, "go"), stop=["STOP"])
    service.handle_message(SchedulerOutputs(started=[started]))
    first, second = encode(tokenizer, "abc ST"), encode(tokenizer, "OP xyz")

    # The first output carries the prefix-cache hit count, as the scheduler sends it.
    opening = StepOutput(rid=started.rid, new_token_ids=first, cached_tokens=3)
    handled = service.handle_message(SchedulerOutputs(steps=[opening]))
    [partial] = _deltas(handled, CLIENT_A)
    assert (partial.text, partial.finished) == ("abc ", False)  # "ST" may start the stop string
    assert handled.to_scheduler == []

    handled = service.handle_message(SchedulerOutputs(steps=[step_output(CLIENT_A, "r1", second)]))
    [final] = _deltas(handled, CLIENT_A)
    assert (final.text, final.finished, final.finish_reason) == ("", True, "stop")
    # Only the tokens up to the one that completed the stop string count ("OP"), as
    # one token at a time would have stopped there.
    assert final.usage is not None and final.token_ids == second[:2]
    assert final.usage.completion_tokens == len(first) + 2
    assert final.usage.cached_tokens == 3  # known before the scheduler's final output
    assert handled.to_scheduler == [AbortRid(rid=started.rid, reason="stop")]

    # What the scheduler produced before it saw the abort, and its final notice, reach no one.
    late = service.handle_message(SchedulerOutputs(steps=[step_output(CLIENT_A, "r1", first)]))
    assert late == Handled({}, [])
    assert service.active_rids == {started.rid}
    notice = step_output(CLIENT_A, "r1", [], reason="abort")
    assert service.handle_message(SchedulerOutputs(steps=[notice])) == Handled({}, [])
    assert service.active_rids == set()


def test_stop_string_in_the_final_step_needs_no_abort(tokenizer: Tokenizer) -> None:
    service = DetokenizerService(tokenizer)
    started = request_started(CLIENT_A, "r1", [], stop=["\n"])
    service.handle_message(SchedulerOutputs(started=[started]))
    final = step_output(CLIENT_A, "r1", encode(tokenizer, "one\ntwo"), reason="length")
    handled = service.handle_message(SchedulerOutputs(steps=[final]))
    [delta] = _deltas(handled, CLIENT_A)
    assert (delta.text, delta.finish_reason) == ("one", "stop")
    assert handled.to_scheduler == []
    assert service.active_rids == set()


def test_a_stop_token_is_reported_but_not_spelled_out(tokenizer: Tokenizer) -> None:
    """A request the scheduler stopped on a token (EOS or a stop_token_id): vLLM leaves the stop
    token's text out; its id is still reported and counted."""
    service = DetokenizerService(tokenizer)
    service.handle_message(SchedulerOutputs(started=[request_started(CLIENT_A, "r1", [])]))
    tokens = encode(tokenizer, "one two")
    final = step_output(CLIENT_A, "r1", tokens, reason="stop")
    [delta] = _deltas(service.handle_message(SchedulerOutputs(steps=[final])), CLIENT_A)
    assert delta.text == tokenizer.decode(tokens[:-1]) and delta.token_ids == tokens
    assert delta.finish_reason == "stop" and delta.usage.completion_tokens == len(tokens)


def test_multibyte_characters_split_across_tokens_never_show_a_replacement_char(
    tokenizer: Tokenizer,
) -> None:
    text = "é世🎉 ok ü"
    generated = list(text.encode("utf-8"))  # the byte tokenizer: token b is byte b
    assert generated == encode(tokenizer, text)
    service = DetokenizerService(tokenizer)
    service.handle_message(SchedulerOutputs(started=[request_started(CLIENT_A, "r1", [256])]))
    deltas = _stream(service, CLIENT_A, "r1", [[token] for token in generated])
    # Every token gets its delta (clients count tokens), even those completing no character.
    assert len(deltas) == len(generated)
    assert any(delta.text == "" for delta in deltas)
    assert all(REPLACEMENT_CHAR not in delta.text for delta in deltas)
    assert "".join(delta.text for delta in deltas) == text


def test_two_clients_get_only_their_own_replies(tokenizer: Tokenizer) -> None:
    service = DetokenizerService(tokenizer)
    # The same request id from two clients: two different requests.
    started = [request_started(CLIENT_A, "r1", []), request_started(CLIENT_B, "r1", [])]
    steps = [
        step_output(CLIENT_A, "r1", encode(tokenizer, "for A")),
        step_output(CLIENT_B, "r1", encode(tokenizer, "for B")),
        step_output(CLIENT_A, "r1", encode(tokenizer, " again"), reason="length"),
    ]
    handled = service.handle_message(SchedulerOutputs(started=started, steps=steps))
    assert set(handled.replies) == {CLIENT_A, CLIENT_B}
    # Each client's first delta is its request's admission, which carries nothing.
    admitted_a, *deltas_a = _deltas(handled, CLIENT_A)
    admitted_b, *deltas_b = _deltas(handled, CLIENT_B)
    assert admitted_a.admission and admitted_b.admission
    assert (admitted_a.request_id, admitted_b.request_id) == ("r1", "r1")
    assert [delta.text for delta in deltas_a] == ["for A", " again"]
    assert [delta.text for delta in deltas_b] == ["for B"]
    assert not any(delta.admission for delta in deltas_a + deltas_b)
    assert service.active_rids == {make_rid(CLIENT_B, "r1")}


def test_request_failed_and_forwarded_stats_become_replies(
    tokenizer: Tokenizer,
) -> None:
    service = DetokenizerService(tokenizer)
    failed = RequestFailed(client_id=CLIENT_B, request_id="r9", code="overloaded", message="full")
    handled = service.handle_message(failed)
    assert handled == Handled(
        {CLIENT_B: [ErrorReply(request_id="r9", code="overloaded", message="full")]}, []
    )
    stats = SAMPLE_STATS
    handled = service.handle_message(
        ForwardedStats(client_id=CLIENT_A, request_id="s1", stats=stats)
    )
    assert handled == Handled({CLIENT_A: [StatsReply(request_id="s1", stats=stats)]}, [])


def test_data_parallel_replicas_answers_are_merged_into_one_reply(tokenizer: Tokenizer) -> None:
    """Each replica answers a stats request; the client gets one reply once all have: their
    counts summed, the longest uptime."""
    service = DetokenizerService(tokenizer, replicas=2)
    first = ForwardedStats(client_id=CLIENT_A, request_id="s1", stats=SAMPLE_STATS)
    assert service.handle_message(first) == Handled({}, [])
    later = msgspec.structs.replace(SAMPLE_STATS, uptime=5.0, total_pages=30)
    handled = service.handle_message(
        ForwardedStats(client_id=CLIENT_A, request_id="s1", stats=later)
    )
    (reply,) = handled.replies[CLIENT_A]
    assert reply.stats.total_pages == 40 and reply.stats.running_requests == 4
    assert reply.stats.uptime == 5.0
    assert reply.stats.generation_throughput == 80.0
    assert reply.stats.cpu == SAMPLE_STATS.cpu


def test_unknown_rid_is_ignored(tokenizer: Tokenizer) -> None:
    service = DetokenizerService(tokenizer)
    steps = [
        step_output(CLIENT_A, "never-started", [65]),
        step_output(CLIENT_A, "other", [66], "stop"),
    ]
    assert service.handle_message(SchedulerOutputs(steps=steps)) == Handled({}, [])
    assert service.handle_message(Shutdown()) == Handled({}, [])


def test_bad_token_id_fails_only_that_request(tokenizer: Tokenizer) -> None:
    service = DetokenizerService(tokenizer)
    started = [request_started(CLIENT_A, "bad", []), request_started(CLIENT_A, "good", [])]
    steps = [step_output(CLIENT_A, "bad", [-1]), step_output(CLIENT_A, "good", [72, 105])]
    handled = service.handle_message(SchedulerOutputs(started=started, steps=steps))
    *admissions, error, delta = handled.replies[CLIENT_A]
    assert [(item.request_id, item.admission) for item in admissions] == [
        ("bad", True),
        ("good", True),
    ]
    assert isinstance(error, ErrorReply)
    assert (error.request_id, error.code) == ("bad", "internal")
    assert isinstance(delta, GenerateDelta)
    assert delta.text == "Hi"
    assert handled.to_scheduler == [AbortRid(rid=make_rid(CLIENT_A, "bad"))]
    assert service.active_rids == {make_rid(CLIENT_A, "good")}


def test_vanished_client_aborts_its_running_requests(tokenizer: Tokenizer) -> None:
    service = DetokenizerService(tokenizer)
    started = [
        request_started(CLIENT_A, "running", []),
        request_started(CLIENT_A, "stopped", [], stop=["x"]),
        request_started(CLIENT_B, "other", []),
    ]
    steps = [step_output(CLIENT_A, "stopped", encode(tokenizer, "x"))]
    handled = service.handle_message(SchedulerOutputs(started=started, steps=steps))
    assert handled.to_scheduler == [AbortRid(rid=make_rid(CLIENT_A, "stopped"), reason="stop")]
    # The stopped request was aborted already; only the running one needs it.
    assert service.client_vanished(CLIENT_A) == [AbortRid(rid=make_rid(CLIENT_A, "running"))]
    assert service.active_rids == {make_rid(CLIENT_B, "other")}
    late = step_output(CLIENT_A, "running", [65])
    assert service.handle_message(SchedulerOutputs(steps=[late])) == Handled({}, [])


def test_a_stop_string_final_delta_waits_for_the_stats_when_asked(tokenizer: Tokenizer) -> None:
    """With return_stats, the delta a stop string ends waits for the scheduler's final output
    (after the abort) and carries its stats; usage still counts up to the stop string."""
    service = DetokenizerService(tokenizer)
    started = request_started(
        CLIENT_A, "r1", encode(tokenizer, "go"), stop=["STOP"], return_stats=True
    )
    service.handle_message(SchedulerOutputs(started=[started]))
    tokens = encode(tokenizer, "abc STOP")
    handled = service.handle_message(SchedulerOutputs(steps=[step_output(CLIENT_A, "r1", tokens)]))
    assert _deltas(handled, CLIENT_A) == []  # held
    assert handled.to_scheduler == [AbortRid(rid=started.rid, reason="stop")]
    final_output = step_output(CLIENT_A, "r1", [], reason="stop")
    handled = service.handle_message(SchedulerOutputs(steps=[final_output]))
    [final] = _deltas(handled, CLIENT_A)
    assert (final.text, final.finished, final.finish_reason) == ("abc ", True, "stop")
    assert final.stats == final_output.stats and final.usage.completion_tokens == len(tokens)
    assert service.handle_message(SchedulerOutputs(steps=[final_output])).replies == {}


def test_prompt_logprobs_come_with_the_first_delta_as_the_prompt_reads(
    tokenizer: Tokenizer,
) -> None:
    """With `prompt_logprobs` the whole prompt crosses the wire (`prompt_tail`), and its
    tokens' texts, in the prompt's own context, come with the first delta only."""
    service = DetokenizerService(tokenizer)
    prompt = encode(tokenizer, "Hey you")
    started = request_started(CLIENT_A, "r", prompt)
    assert len(prompt) == 7 and started.prompt_tail == prompt  # shorter than any tail
    scored = [TokenLogprob(-0.25 * i, [(prompt[i], -0.25 * i), (65, -3.0)]) for i in range(1, 7)]
    first = step_output(CLIENT_A, "r", [33])
    first.prompt_logprobs = scored
    handled = service.handle_message(SchedulerOutputs(started=[started], steps=[first]))
    (admitted, delta) = _deltas(handled, CLIENT_A)
    assert admitted.admission and admitted.prompt_logprobs is None
    assert delta.text == "!"
    assert delta.prompt_logprobs.first_token == "H"
    entries = delta.prompt_logprobs.entries
    assert "".join(entry.token.text for entry in entries) == "ey you"
    assert [entry.token.logprob for entry in entries] == [-0.25 * i for i in range(1, 7)]
    assert [alt.text for alt in entries[0].top] == ["e", "A"]
    (last,) = _stream(service, CLIENT_A, "r", [[33]])
    assert last.prompt_logprobs is None and last.finished


def test_prompt_logprobs_for_a_prompt_the_detokenizer_lacks_fail_only_that_request(
    tokenizer: Tokenizer,
) -> None:
    """Entries that do not fit the prompt it has (the tail of a request registered without
    prompt logprobs) are the request's internal error; the scheduler is told to abort it."""
    service = DetokenizerService(tokenizer)
    started = request_started(CLIENT_A, "r", encode(tokenizer, "x" * 40))
    first = step_output(CLIENT_A, "r", [33])
    first.prompt_logprobs = [TokenLogprob(-1.0, []) for _ in range(39)]
    handled = service.handle_message(SchedulerOutputs(started=[started], steps=[first]))
    (admitted, error) = handled.replies[CLIENT_A]
    assert admitted.admission
    assert isinstance(error, ErrorReply) and error.code == "internal"
    assert "prompt logprobs" in error.message
    assert handled.to_scheduler == [AbortRid(rid=make_rid(CLIENT_A, "r"))]
