"""The tokenizer process: request validation and routing (no sockets), then one real process."""

from __future__ import annotations

import select
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.load import Checkpoint, load_checkpoint
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.tokenizer import Tokenizer
from baton.child_process import start_child
from baton.config import BatonConfig
from baton.messages import (
    PROMPT_TAIL_TOKENS,
    AbortRequest,
    AbortRid,
    ChatMessage,
    Codec,
    DetokenizerMessage,
    ForwardedStatsRequest,
    GenerateRequest,
    LauncherMessage,
    RequestFailed,
    SchedulerMessage,
    Shutdown,
    StatsRequest,
    TokenizedRequest,
    make_rid,
)
from baton.sampling_params import SamplingParams
from baton.tokenizer_proc.process import OFFLOAD_PROMPT_CHARS, TokenizerService

CLIENT = b"client-7"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def service(random_checkpoint: Checkpoint) -> TokenizerService:
    """The default model's byte tokenizer with a short context, to reach the limits cheaply."""
    vocab = random_checkpoint.config.vocab_size
    return TokenizerService(random_checkpoint.tokenizer, vocab, MAX_MODEL_LEN, "fcfs")


@pytest.fixture(scope="module")
def stories_service(stories260k_dir: Path) -> TokenizerService:
    """A real trained tokenizer (SentencePiece-style BPE, BOS added, no chat template)."""
    return TokenizerService.from_config(BatonConfig(model=str(stories260k_dir)))


def _frame(message: Any) -> bytes:
    return msgspec.msgpack.encode(message)


def _generate(**fields: Any) -> bytes:
    """A hand-built generate frame: any field, of any type, as a client could send it."""
    return _frame({"type": "generate", "request_id": "r1", **fields})


def _single(outputs: list, destination: str, kind: type) -> Any:
    assert len(outputs) == 1, outputs
    sent_to, message = outputs[0]
    assert sent_to == destination, message
    assert isinstance(message, kind), message
    return message


def _failure(outputs: list, code: str = "invalid_request", request_id: str = "r1") -> str:
    failed = _single(outputs, "detokenizer", RequestFailed)
    assert (failed.client_id, failed.request_id, failed.code) == (CLIENT, request_id, code)
    return failed.message


def test_text_prompt_is_tokenized(stories_service: TokenizerService) -> None:
    params = SamplingParams(temperature=0.5, max_tokens=8, stop=["."])
    request = GenerateRequest(
        request_id="r1", prompt="Once upon a time", params=params, skip_special_tokens=False
    )
    before = time.monotonic()
    outputs = stories_service.handle(CLIENT, _frame(request))
    tokenized = _single(outputs, "scheduler", TokenizedRequest)
    tokenizer = stories_service.tokenizer
    assert tokenized.prompt_token_ids == tokenizer.encode("Once upon a time")
    assert tokenized.prompt_token_ids[0] == tokenizer.bos_token_id
    assert tokenized.rid == make_rid(CLIENT, "r1")
    # The scheduler gets the sampling parameters but the stop strings; the detokenizer's
    # registration gets those, whom to reply to, and the prompt's length and tail.
    assert tokenized.params == msgspec.structs.replace(params, stop=None)
    started = tokenized.started
    assert (started.rid, started.client_id, started.request_id) == (tokenized.rid, CLIENT, "r1")
    assert (started.stop, started.skip_special_tokens) == (["."], False)
    assert started.prompt_tokens == len(tokenized.prompt_token_ids)
    assert started.prompt_tail == tokenized.prompt_token_ids[-PROMPT_TAIL_TOKENS:]
    assert before <= tokenized.arrival_time <= time.monotonic()


def test_priority_and_deadline_reach_the_scheduler(random_checkpoint: Checkpoint) -> None:
    vocab = random_checkpoint.config.vocab_size
    service = TokenizerService(random_checkpoint.tokenizer, vocab, MAX_MODEL_LEN, "priority")
    frame = _generate(prompt_token_ids=[1, 2], priority=-2, deadline_ms=150.5)
    tokenized = _single(service.handle(CLIENT, frame), "scheduler", TokenizedRequest)
    assert (tokenized.priority, tokenized.deadline_ms) == (-2, 150.5)
    for bad in (0, -1.0, float("inf")):
        message = _failure(service.handle(CLIENT, _generate(prompt_token_ids=[1], deadline_ms=bad)))
        assert "deadline_ms must be a positive number" in message


@pytest.mark.parametrize("policy", ["fcfs", "edf", "lrs"])
def test_a_priority_needs_the_priority_policy(random_checkpoint: Checkpoint, policy: str) -> None:
    """vLLM's check and wording; once accepted and ignored under fcfs (HTTP probe)."""
    vocab = random_checkpoint.config.vocab_size
    service = TokenizerService(random_checkpoint.tokenizer, vocab, MAX_MODEL_LEN, policy)  # type: ignore[arg-type]
    refused = _failure(service.handle(CLIENT, _generate(prompt_token_ids=[1], priority=3)))
    assert refused == "Got priority 3 but Priority scheduling is not enabled."
    zero = _generate(prompt_token_ids=[1], priority=0, deadline_ms=5.0)
    _single(service.handle(CLIENT, zero), "scheduler", TokenizedRequest)


def test_text_prompt_without_special_tokens(stories_service: TokenizerService) -> None:
    frame = _generate(prompt="Once upon a time", add_special_tokens=False)
    tokenized = _single(stories_service.handle(CLIENT, frame), "scheduler", TokenizedRequest)
    expected = stories_service.tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert tokenized.prompt_token_ids == expected
    assert stories_service.tokenizer.bos_token_id not in expected


def test_token_ids_pass_through(service: TokenizerService) -> None:
    ids = [0, 5, service.vocab_size - 1]
    tokenized = _single(
        service.handle(CLIENT, _generate(prompt_token_ids=ids)), "scheduler", TokenizedRequest
    )
    assert tokenized.prompt_token_ids == ids
    assert tokenized.params == SamplingParams()


def test_chat_messages_use_the_fallback(stories_service: TokenizerService) -> None:
    messages = [ChatMessage(role="user", content="Tell me a story")]
    frame = _frame(GenerateRequest(request_id="r1", messages=messages))
    tokenized = _single(stories_service.handle(CLIENT, frame), "scheduler", TokenizedRequest)
    expected = stories_service.tokenizer.encode("user: Tell me a story\nassistant:")
    assert tokenized.prompt_token_ids == expected


def test_chat_options_reach_the_template(service: TokenizerService) -> None:
    """vLLM's chat template fields over the wire: the final message left open, and the kwargs
    as template variables (the byte template writes `bos_token`)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    chat = {"add_generation_prompt": False, "continue_final_message": True}
    frame = _generate(messages=messages, chat={**chat, "chat_template_kwargs": {"bos_token": "B"}})
    tokenized = _single(service.handle(CLIENT, frame), "scheduler", TokenizedRequest)
    eos = service.tokenizer.eos_token_id
    assert tokenized.prompt_token_ids == [*b"B<|user|>\nhi", eos, *b"\n<|assistant|>\nHel"]
    # The request's own switch wins over a kwarg of the same name (vLLM's merge).
    overridden = {"chat_template_kwargs": {"add_generation_prompt": False}}
    frame = _generate(messages=messages, chat=overridden)
    tokenized = _single(service.handle(CLIENT, frame), "scheduler", TokenizedRequest)
    assert tokenized.prompt_token_ids[-len(b"<|assistant|>\n") :] == [*b"<|assistant|>\n"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"chat": {"continue_final_message": True}},
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        ({"chat": {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}}, "chat templates"),
        ({"chat": {"chat_template_kwargs": {"tokenize": False}}}, "`tokenize`"),
        ({"chat": {"chat_template_kwargs": {"messages": []}}}, "`messages`"),
        ({"chat": {"chat_template_kwargs": {"tools": []}}}, "tools are not supported"),
        (
            {"chat": {"chat_template_kwargs": {"x": 1}}, "messages": None, "prompt": "a"},
            "need `messages`",
        ),
        ({"chat": {"chat_template_kwargs": [1]}}, "Expected `object`, got `array`"),
    ],
)
def test_chat_options_that_cannot_be_honoured(
    service: TokenizerService, fields: dict, expected: str
) -> None:
    frame = _generate(**{"messages": [{"role": "user", "content": "a"}], **fields})
    assert expected in _failure(service.handle(CLIENT, frame))


def test_a_final_message_the_template_does_not_write_cannot_be_continued(
    random_checkpoint: Checkpoint,
) -> None:
    template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    tokenizer = Tokenizer(
        random_checkpoint.tokenizer.backend, random_checkpoint.tokenizer.special_tokens, template
    )
    service = TokenizerService(tokenizer, 259, MAX_MODEL_LEN, "fcfs")
    chat = {"add_generation_prompt": False, "continue_final_message": True}
    frame = _generate(messages=[{"role": "assistant", "content": "abc"}], chat=chat)
    assert "does not appear" in _failure(service.handle(CLIENT, frame))
    # A template that fails on a request's variables is the request's error, not the server's.
    failing = "{{ messages | length + limit }}"
    tokenizer = Tokenizer(
        random_checkpoint.tokenizer.backend, random_checkpoint.tokenizer.special_tokens, failing
    )
    service = TokenizerService(tokenizer, 259, MAX_MODEL_LEN, "fcfs")
    frame = _generate(
        messages=[{"role": "user", "content": "a"}],
        chat={"chat_template_kwargs": {"limit": "ten"}},
    )
    assert "the chat template failed" in _failure(service.handle(CLIENT, frame))


@pytest.mark.parametrize(
    ("fields", "found"),
    [
        ({}, "none"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt, prompt_token_ids"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt, messages"),
    ],
)
def test_exactly_one_prompt_field(service: TokenizerService, fields: dict, found: str) -> None:
    message = _failure(service.handle(CLIENT, _generate(**fields)))
    assert "exactly one of prompt, prompt_token_ids and messages" in message
    assert f"(got {found})" in message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"prompt": "a", "params": {"temperature": "hot"}}, "`$.params.temperature`"),
        ({"prompt": "a", "params": {"max_tokens": -1}}, "max_tokens must be >= 1, got -1"),
        ({"prompt": "a", "params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"prompt": "a", "params": {"stop_token_ids": [10**6]}}, "stop_token_ids entry 1000000"),
        ({"prompt_token_ids": [1, "2"]}, "Expected `int`, got `str` - at `$.prompt_token_ids[1]`"),
        ({"prompt_token_ids": [1, 259]}, "prompt_token_ids[1] = 259 is outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids[0] = -1 is outside the vocabulary"),
        ({"prompt": 5}, "Expected `str | null`, got `int` - at `$.prompt`"),
        ({"prompt": "", "add_special_tokens": False}, "the prompt is empty"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role is 'tool'"),
        ({"messages": [{"role": "user"}]}, "missing required field `content`"),
    ],
)
def test_invalid_requests(service: TokenizerService, fields: dict, expected: str) -> None:
    assert expected in _failure(service.handle(CLIENT, _generate(**fields)))


def test_request_id_must_be_a_non_empty_string(service: TokenizerService) -> None:
    missing = _frame({"type": "generate", "prompt": "a"})
    assert "request_id" in _failure(service.handle(CLIENT, missing), request_id="")
    empty = _frame(GenerateRequest(request_id="", prompt="a"))
    assert "request_id must be non-empty" in _failure(service.handle(CLIENT, empty), request_id="")
    number = _frame({"type": "abort", "request_id": 3})
    assert "`$.request_id`" in _failure(service.handle(CLIENT, number), request_id="")


INVALID_UTF8_FRAME = b"\x81\xa4type\xa3\xed\xa0\x80"


def test_garbage_and_unknown_tags(service: TokenizerService) -> None:
    garbage = _failure(service.handle(CLIENT, b"\xc1\x00not msgpack"), request_id="")
    assert garbage.startswith("malformed message:")
    unknown = _failure(service.handle(CLIENT, _frame({"type": "launch", "request_id": "r1"})))
    assert "'launch'" in unknown and "`$.type`" in unknown
    untagged = _failure(service.handle(CLIENT, _frame(["generate", "r1"])), request_id="")
    assert "Expected `object`, got `array`" in untagged
    deeply_nested = b"\x91" * 100_000 + b"\x01"  # overflows an untyped decoder's recursion
    assert "malformed" in _failure(service.handle(CLIENT, deeply_nested), request_id="")
    # {"type": <invalid UTF-8>}: msgspec raises UnicodeDecodeError, which once killed the process.
    bad_utf8 = _failure(service.handle(CLIENT, INVALID_UTF8_FRAME), request_id="")
    assert bad_utf8.startswith("malformed message:")


def test_prompt_length_limits(service: TokenizerService) -> None:
    fits = service.handle(CLIENT, _generate(prompt_token_ids=[1] * 63, params={"max_tokens": None}))
    assert len(_single(fits, "scheduler", TokenizedRequest).prompt_token_ids) == 63
    frame = _generate(prompt_token_ids=[1] * 64, params={"max_tokens": None})
    assert _failure(service.handle(CLIENT, frame), code="prompt_too_long") == (
        "This model's maximum context length is 64 tokens. However, your request has 64 input "
        "tokens. Please reduce the length of the input messages."
    )


def test_prompt_plus_max_tokens_limit(service: TokenizerService) -> None:
    fits = service.handle(CLIENT, _generate(prompt_token_ids=[1] * 60, params={"max_tokens": 4}))
    _single(fits, "scheduler", TokenizedRequest)
    frame = _generate(prompt_token_ids=[1] * 60, params={"max_tokens": 5})
    assert _failure(service.handle(CLIENT, frame), code="prompt_too_long") == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(60 in the messages, 5 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_long_chat_is_measured_after_rendering(service: TokenizerService) -> None:
    messages = [ChatMessage(role="user", content="x" * 40)]  # + ~25 template bytes > 64
    frame = _frame(GenerateRequest(request_id="r1", messages=messages))
    assert "context length is 64" in _failure(service.handle(CLIENT, frame), code="prompt_too_long")


def test_abort_stats_and_shutdown(service: TokenizerService) -> None:
    abort = service.handle(CLIENT, _frame(AbortRequest(request_id="r9", reason="stop")))
    assert _single(abort, "scheduler", AbortRid) == AbortRid(
        rid=make_rid(CLIENT, "r9"), reason="stop"
    )
    # A reason is a finish reason of the wire protocol: any other is a malformed frame.
    bogus = _frame({"type": "abort", "request_id": "r9", "reason": "cancelled"})
    assert "Invalid enum value 'cancelled'" in _failure(
        service.handle(CLIENT, bogus), "invalid_request", "r9"
    )
    stats = _single(
        service.handle(CLIENT, _frame(StatsRequest(request_id="s1"))),
        "scheduler",
        ForwardedStatsRequest,
    )
    assert (stats.client_id, stats.request_id) == (CLIENT, "s1")
    # Clients cannot stop the server: Shutdown is not a client message.
    (failed,) = service.handle(CLIENT, msgspec.msgpack.encode(Shutdown()))
    assert failed[0] == "detokenizer" and failed[1].code == "invalid_request"


def test_multipart_needs_exactly_one_frame(service: TokenizerService) -> None:
    frame = _generate(prompt="a")
    message = _failure(service.handle_multipart([CLIENT, frame, frame]), request_id="")
    assert "expected one message frame, got 2" in message
    _single(service.handle_multipart([CLIENT, frame]), "scheduler", TokenizedRequest)


class _BrokenTokenizer:
    """A tokenizer that fails on every call, standing in for a tokenizer bug."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("tokenizer exploded")

    max_chars_per_token = 4


def test_tokenizer_failure_is_an_internal_error() -> None:
    broken = TokenizerService(_BrokenTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    message = _failure(broken.handle(CLIENT, _generate(prompt="a")), code="internal")
    assert "tokenizer exploded" in message
    # Requests that need no tokenizer are unaffected.
    abort = broken.handle(CLIENT, _frame(AbortRequest(request_id="r1")))
    _single(abort, "scheduler", AbortRid)


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(
    stories_service: TokenizerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 32 MB prompt once took 35 s to tokenize and refuse while every other request waited."""
    limit = stories_service.max_prompt_chars
    assert limit == stories_service.max_model_len * stories_service.tokenizer.max_chars_per_token
    # Every vocabulary entry spells at most half the bound: no fitting prompt is refused.
    longest = max(len(t) for t in stories_service.tokenizer.backend.get_vocab())
    assert limit == 2 * longest * stories_service.max_model_len

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(stories_service.tokenizer, "encode", never)  # chat prompts too
    huge = "a" * (limit + 1)
    message = _failure(stories_service.handle(CLIENT, _generate(prompt=huge)), "prompt_too_long")
    assert f"{limit + 1} characters" in message
    chat = [{"role": "user", "content": huge[: limit // 2]}] * 3
    _failure(stories_service.handle(CLIENT, _generate(messages=chat)), "prompt_too_long")
    ids = [1] * (stories_service.max_model_len + 1)
    _failure(stories_service.handle(CLIENT, _generate(prompt_token_ids=ids)), "prompt_too_long")


def test_max_model_len_past_the_model_is_refused(random_checkpoint: Checkpoint) -> None:
    model = random_checkpoint.config
    positions = model.max_position_embeddings
    assert (
        model.served_context_length(BatonConfig(model=RANDOM_MODEL_NAME).max_model_len) == positions
    )
    assert model.served_context_length(100) == 100
    assert model.served_context_length(positions) == positions
    for length in (positions + 1, 0):  # once silently capped at the positions
        with pytest.raises(ValueError, match=f"give at most {positions}"):
            model.served_context_length(length)


def _receive(socket: zmq.Socket, codec: Codec, timeout_s: float) -> Any:
    assert socket.poll(int(timeout_s * 1000)), "nothing arrived in time"
    return codec.decode_or_none(socket.recv())


def test_real_process_round_trip() -> None:
    """Start `python -m baton.tokenizer_proc` with fake neighbours and talk to it over ZMQ."""
    config = BatonConfig(model=RANDOM_MODEL_NAME, log_level="warning")
    addresses = ServerAddresses.create()
    context = zmq.Context()
    neighbours = {}
    for name in ("scheduler", "detokenizer", "launcher"):
        neighbours[name] = context.socket(zmq.PULL)
        neighbours[name].bind(getattr(addresses, name))
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.ROUTING_ID, CLIENT)
    process = start_child("baton.tokenizer_proc", config, addresses)
    try:
        # Generous: the child imports transformers, and the suite may share the CPU.
        ready = _receive(neighbours["launcher"], Codec(LauncherMessage), timeout_s=120)
        assert (ready.name, ready.error) == ("tokenizer", None)
        assert ready.info["max_model_len"] == str(
            load_checkpoint(RANDOM_MODEL_NAME).config.max_position_embeddings
        )
        client.connect(addresses.requests)
        client.send(_frame(GenerateRequest(request_id="r1", prompt="hi")))
        tokenized = _receive(neighbours["scheduler"], Codec(SchedulerMessage), timeout_s=10)
        assert isinstance(tokenized, TokenizedRequest)
        assert (tokenized.rid, tokenized.prompt_token_ids) == (
            make_rid(CLIENT, "r1"),
            [256, *b"hi"],
        )
        client.send(b"garbage")
        failed = _receive(neighbours["detokenizer"], Codec(DetokenizerMessage), timeout_s=10)
        assert isinstance(failed, RequestFailed)
        assert (failed.client_id, failed.code) == (CLIENT, "invalid_request")
        process.terminate()  # the launcher stops the tokenizer with SIGTERM
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        context.destroy(linger=0)
        shutil.rmtree(addresses.directory, ignore_errors=True)


class _SlowTokenizer:
    """Takes half a second over a long text, as a real one does over hundreds of kilobytes."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= OFFLOAD_PROMPT_CHARS:
            time.sleep(0.5)
        return [1, 2, 3]

    max_chars_per_token = 400  # long entries: a long prompt may fit the context


def test_a_large_prompt_is_tokenized_beside_the_loop_and_its_abort_waits_for_it() -> None:
    """A 4 MB prompt once held up every other request for 1.8 s."""
    service = TokenizerService(_SlowTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    service.start_offload()
    assert service.offload is not None
    try:
        started = time.monotonic()
        large = _generate(request_id="large", prompt="b" * OFFLOAD_PROMPT_CHARS)
        assert service.handle(CLIENT, large) == []  # on the worker
        small = _single(
            service.handle(CLIENT, _generate(prompt="b")), "scheduler", TokenizedRequest
        )
        abort = _frame(AbortRequest(request_id="large"))
        assert service.handle(CLIENT, abort) == []  # held: the request is not forwarded yet
        assert time.monotonic() - started < 0.3  # nobody waited for the large prompt
        assert small.started.request_id == "r1"
        assert select.select([service.offload.wake_fd], [], [], 10)[0]
        (_, tokenized), (_, held) = service.offload.completed()
        assert isinstance(tokenized, TokenizedRequest) and tokenized.started.request_id == "large"
        assert held == AbortRid(rid=make_rid(CLIENT, "large"))
        # Once forwarded, its aborts go straight through again.
        _single(service.handle(CLIENT, abort), "scheduler", AbortRid)
    finally:
        service.offload.close()


def test_a_request_reusing_the_id_of_one_on_the_worker_is_refused() -> None:
    """Large or small: a small one would overtake the first to the scheduler, and an abort held
    for the first would then reach it."""
    service = TokenizerService(_SlowTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    service.start_offload()
    assert service.offload is not None
    try:
        large = _generate(prompt="b" * OFFLOAD_PROMPT_CHARS)
        assert service.handle(CLIENT, large) == []
        assert "already running" in _failure(service.handle(CLIENT, large))
        assert "already running" in _failure(service.handle(CLIENT, _generate(prompt="b")))
    finally:
        service.offload.close()
