"""One streamed reply's text as it comes, split into its parts: the reasoning (under
--reasoning-parser), then the content, held back where it may open a tool call, and the calls
once the reply is complete. The chat and Responses stream writers share it."""

from __future__ import annotations

from typing import Any

from baton.frontend.tools import ToolCallStream, ToolPlan
from baton.reasoning import ReasoningSplit


class StreamedReply:
    """Splits one choice's deltas; `opens_in_reasoning` once its admission says the reply
    starts inside the reasoning block and the server splits it off."""

    def __init__(self, plan: ToolPlan) -> None:
        self._split: ReasoningSplit | None = None
        self._tools = ToolCallStream(plan) if plan.mode != "none" else None

    def opens_in_reasoning(self) -> None:
        self._split = ReasoningSplit(in_reasoning=True)

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """The reasoning, the content sure to be content, and (when `finished`) the calls
        that this delta's `text` completes."""
        thought, content = "", text
        if self._split is not None:
            thought, content = self._split.feed(text)
            if finished:
                thought += self._split.finish()
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            content = self._tools.content(content)
            if finished:
                rest, calls = self._tools.finish()
                content += rest
        return thought, content, calls
