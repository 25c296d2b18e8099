"""uvicorn's HTTP/1.1 protocol (httptools), but a request it cannot even parse (a malformed
`Content-Length`, a broken request line) gets OpenAI's error JSON like every other error,
instead of uvicorn's plain-text "Invalid HTTP request received."."""

from __future__ import annotations

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from baton.frontend.errors import OpenAIError


class OpenAIErrorHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose parse-error 400 is `{"error": {...}}`."""

    def send_400_response(self, msg: str) -> None:
        body = msgspec.json.encode(OpenAIError(400, msg).payload())
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
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
