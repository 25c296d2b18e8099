"""uvicorn's HTTP/1.1 protocol (httptools), with two changes. A request it cannot even parse (a
malformed `Content-Length`, a broken request line) gets OpenAI's error JSON like every other
error, instead of uvicorn's plain-text "Invalid HTTP request received.". A request head (its
request line and headers) past MAX_HEADERS header fields or MAX_HEAD_BYTES gets 431.

The head is bounded here, while it is parsed, because neither httptools nor uvicorn bounds it:
by the time an ASGI middleware sees the request, its whole head, however large, is buffered and
every header listed. httptools hands a header over only once it has ended, so a header that
never ends is bounded by the reads that come while the head is incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from baton.frontend.errors import OpenAIError

# A real client sends a few KiB of head in a dozen or two headers (the OpenAI SDK about 15;
# browsers, cookies included, stay within nginx's default of 32 KiB). The count is Apache's and
# gunicorn's default (LimitRequestFields); the size twice nginx's, and four times Node's 16 KiB.
# vLLM, served by h11 rather than httptools, defaults to 256 headers and 4 MiB.
MAX_HEADERS = 100
MAX_HEAD_BYTES = 64 * 1024


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop the parse: httptools hands it to uvicorn as a parse
    error, which uvicorn answers with send_400_response."""


@dataclass
class _Head:
    """What has come of one request's head so far, and of its trailers (header fields after a
    chunked body, which count against the same bounds)."""

    # Its URL, header names and values, as httptools has handed them over.
    parsed_bytes: int = 0
    # The reads that came after it began and left it incomplete, which httptools buffers (a read
    # that also holds its start or its end is left out: part of it may be an earlier message, or
    # the body).
    buffered_bytes: int = 0
    complete: bool = False  # its headers have ended: reads now hold its body and trailers


class OpenAIErrorHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose parse-error 400 is `{"error": {...}}`, and which answers a head
    past the bounds with 431 before reading the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head: _Head | None = None  # the latest request's
        self._refusal: OpenAIError | None = None  # why a parser callback stopped the parse

    def data_received(self, data: bytes) -> None:
        head = self._head
        super().data_received(data)
        if head is None or head.complete or head is not self._head or self.transport.is_closing():
            return
        head.buffered_bytes += len(data)
        if head.buffered_bytes > MAX_HEAD_BYTES:
            self._send_error(_head_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = _Head()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value))

    def on_headers_complete(self) -> None:
        assert self._head is not None
        self._head.complete = True
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        self._send_error(self._refusal or OpenAIError(400, msg))

    def _count_head(self, size: int) -> None:
        head = self._head
        assert head is not None  # httptools begins every message before its fields
        head.parsed_bytes += size
        if len(self.headers) > MAX_HEADERS:  # uvicorn lists the trailers with the headers
            self._refusal = OpenAIError(431, f"more than {MAX_HEADERS} header fields")
        elif head.parsed_bytes > MAX_HEAD_BYTES:
            self._refusal = _head_too_large()
        if self._refusal is not None:
            raise HeadTooLarge(self._refusal.message)

    def _send_error(self, error: OpenAIError) -> None:
        """Answers `error` as OpenAI's JSON and closes the connection (what is left of the
        request cannot be told from the next one)."""
        body = msgspec.json.encode(error.payload())
        status = HTTPStatus(error.status)
        head = [b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())]
        head += [
            name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
        ]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _head_too_large() -> OpenAIError:
    return OpenAIError(431, f"request line and header fields larger than {MAX_HEAD_BYTES} bytes")
