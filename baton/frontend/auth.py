"""API-key check: with `api_key` set, every route but /health and /metrics needs
"Authorization: Bearer <key>": the /v1 API, /tokenize and /detokenize (they make the server
work), and /server_info, /version and /openapi.json (they describe the model, the machine and
the scheduler to whoever asks). vLLM checks /v1 only; here a route is closed unless it is named
open, so one added later cannot be left open by mistake.

/health and /metrics stay open, as in vLLM, so probes and scrapers need no secret. A pure ASGI
middleware, so a request without the key is refused before its body is read.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from baton.frontend.errors import OpenAIError

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """Answers 401 (OpenAI's error JSON) to protected requests without the right bearer token."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Constant-time comparison: the key must not leak through response timing.
        if secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        reason = "Missing" if not given else "Invalid"
        error = OpenAIError(401, f"{reason} API key: send 'Authorization: Bearer <key>'")
        await error.response()(scope, receive, send)
