"""Request body size limit: 413 for a body over `max_bytes`, announced or streamed.

A pure ASGI middleware: it refuses an announced Content-Length over the limit at once, otherwise
reads the body (counting, so a chunked upload cannot exceed the limit either) and replays it to
the app as one message. After the replay, `receive` is the server's own, so the app still sees
the client's disconnect.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.frontend.errors import OpenAIError

# JSON spells one character in at most 12 bytes (an escaped surrogate pair, "\ud83d\ude00").
MAX_JSON_BYTES_PER_CHAR = 12
# More characters than one token of any vocabulary covers. The tokenizer process refuses a prompt
# by its own tokenizer's bound (Tokenizer.max_chars_per_token: 14 for the byte tokenizer, 162 for
# SmolLM2's); the frontend does not load the tokenizer, so it admits the worst case of any.
MAX_CHARS_PER_TOKEN = 1024
# Room for every other field of a request: stop strings, logit_bias, tools...
OTHER_FIELDS_BYTES = 1 << 20
# Never more than this by default: the bound above is a worst case (every character escaped, every
# token the longest), and for a long-context model it would let one request buffer hundreds of MB.
MAX_DEFAULT_BODY_BYTES = 32 << 20


def default_body_limit(max_model_len: int) -> int:
    """A body limit that admits the longest prompt the context can hold, however it is escaped
    (up to 32 MiB), and refuses at once what could only be refused after reading and
    tokenizing it."""
    worst_case = max_model_len * MAX_CHARS_PER_TOKEN * MAX_JSON_BYTES_PER_CHAR
    return min(worst_case + OTHER_FIELDS_BYTES, MAX_DEFAULT_BODY_BYTES)


class BodySizeLimitMiddleware:
    """Buffers each request body up to `max_bytes`; larger bodies get 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope["headers"]).get(b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(413, f"request body larger than {self.max_bytes} bytes")
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that returns `body` once, then defers to the server's."""
    replayed = False

    async def replaying_receive() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replaying_receive
