"""The HTTP protocol's bounds on a request head, over raw sockets: too many header fields, or
too many bytes of them (a header that never ends included), get 431 in OpenAI's error JSON
before the request reaches the app."""

from __future__ import annotations

import contextlib
import socket

import msgspec

from baton.config import BatonConfig
from baton.frontend.http_protocol import MAX_HEAD_BYTES, MAX_HEADERS

# /health needs no API key, so a head the bounds let through gets its 200.
REQUEST_LINE = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def exchange(config: BatonConfig, request: bytes) -> bytes:
    """The server's whole answer to `request` (it closes the connection after an error)."""
    with socket.create_connection((config.host, config.port), 30) as connection:
        # Refused before the rest is read, the answer comes first.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            connection.sendall(request)
        reply = b""
        try:
            while chunk := connection.recv(65536):
                reply += chunk
        except ConnectionResetError:  # the unread rest of the request resets the connection
            pass
    return reply


def assert_431(reply: bytes, message: str) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), reply[:200]
    assert b"content-type: application/json" in head.lower()
    error = msgspec.json.decode(body)["error"]
    assert error["code"] == "headers_too_large" and message in error["message"], error


def fields(count: int, value: bytes = b"v") -> bytes:
    return b"".join(b"X-Field-%d: %s\r\n" % (index, value) for index in range(count))


def test_header_fields_past_the_count_are_431(restricted_frontend: BatonConfig) -> None:
    """Up to the bounds, a head is served: far more, and larger, headers than a real client
    sends. One field more, or 10,000 lines, is refused."""
    value = b"v" * (MAX_HEAD_BYTES * 3 // 4 // MAX_HEADERS)
    close = b"Connection: close\r\n\r\n"  # with Host, the last two of MAX_HEADERS
    reply = exchange(restricted_frontend, REQUEST_LINE + fields(MAX_HEADERS - 2, value) + close)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    reply = exchange(restricted_frontend, REQUEST_LINE + fields(MAX_HEADERS - 1, value) + close)
    assert_431(reply, f"more than {MAX_HEADERS} header fields")
    reply = exchange(restricted_frontend, REQUEST_LINE + fields(10_000) + b"\r\n")
    assert_431(reply, f"more than {MAX_HEADERS} header fields")


def test_a_one_megabyte_header_is_431(restricted_frontend: BatonConfig) -> None:
    """Whether it comes in one read or many; so is one just past the bound (in one read, as a
    rule: then it is the parsed header that is measured)."""
    for size in (1_000_000, MAX_HEAD_BYTES):
        huge = b"X-Huge: " + b"a" * size + b"\r\n"
        reply = exchange(restricted_frontend, REQUEST_LINE + huge + b"\r\n")
        assert_431(reply, f"larger than {MAX_HEAD_BYTES} bytes")


def test_a_header_that_never_ends_is_431_before_it_ends(restricted_frontend: BatonConfig) -> None:
    """httptools hands a header over only once it ends: this one is refused by the bytes read
    while it is still open, not buffered until the client stops."""
    reply = exchange(restricted_frontend, REQUEST_LINE + b"X-Endless: " + b"a" * 1_000_000)
    assert_431(reply, f"larger than {MAX_HEAD_BYTES} bytes")
