"""Content blocks of a Messages response, from the output text as it grows.

An event source turns the text into ordered events: ("text", str), ("call", name) and ("args", JSON
fragment). Without tools all of it is text; with tools the chat path's StreamingToolParser splits it.
`ContentBlocks` folds the events into blocks (a text block, a tool_use block per call, in the order
the text holds them) and returns Anthropic's stream events as it goes. The non-streamed response is
the same fold over the finished text, so a streamed message and a non-streamed one agree.
"""

from __future__ import annotations

import secrets
from typing import Any

import pydantic_core

from kvflow.entrypoints.openai.tool_parsers import StreamingToolParser, ToolCallFormat

Event = tuple[str, str]


class TextEvents:
    """No tools: the output is all text."""

    def __init__(self) -> None:
        self._sent = 0

    def feed(self, text: str, final: bool) -> list[Event]:
        new, self._sent = text[self._sent :], len(text)
        return [("text", new)] if new else []


class ToolEvents:
    """Tools: the chat path's parser reads the text (content, calls and their argument fragments, in
    the output's order, the same however the text is cut)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._parser = StreamingToolParser(fmt)

    def feed(self, text: str, final: bool) -> list[Event]:
        out: list[Event] = []
        for event in self._parser.events(text, final):
            if event[0] == "content":
                out.append(("text", event[1]))
            elif event[0] == "call":  # ("call", index, name, id): blocks have their own ids
                out.append(("call", event[2]))
            else:  # ("args", index, fragment): always of the call announced last
                out.append(("args", event[2]))
        return out


def event_source(fmt: ToolCallFormat | None) -> TextEvents | ToolEvents:
    return TextEvents() if fmt is None else ToolEvents(fmt)


def events_of(fmt: ToolCallFormat | None, text: str) -> list[Event]:
    """The events of a finished text (a non-streamed response)."""
    return event_source(fmt).feed(text, True)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


class ContentBlocks:
    """Folds events into content blocks. `add` and `close` return the stream events of the step
    (content_block_start / _delta / _stop, as dicts whose "type" is the SSE event name)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._json: dict[int, str] = {}  # tool_use block index -> its input JSON text so far
        self._open = False

    @property
    def has_tool_use(self) -> bool:
        return bool(self._json)

    def add(self, event: Event) -> list[dict[str, Any]]:
        kind, value = event
        if kind == "call":
            out = self._start({"type": "tool_use", "id": tool_use_id(), "name": value, "input": {}})
            self._json[len(self.blocks) - 1] = ""
            return out
        if not value:
            return []
        if kind == "args":  # the arguments of the call opened last (a call's arguments follow its name)
            index = max(self._json)
            self._json[index] += value
            return [_delta(index, {"type": "input_json_delta", "partial_json": value})]
        if self._open and self.blocks[-1]["type"] == "text":
            out = []
        else:
            if self.blocks:  # text after a call: the parser keeps the whitespace that separated them
                value = value.lstrip()
                if not value:
                    return []
            out = self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += value
        return [*out, _delta(len(self.blocks) - 1, {"type": "text_delta", "text": value})]

    def close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def content(self) -> list[dict[str, Any]]:
        return [
            {**b, "input": tool_input(self._json[i])} if i in self._json else dict(b) for i, b in enumerate(self.blocks)
        ]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.blocks.append(block)
        self._open = True
        return [*out, {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def tool_input(text: str) -> dict[str, Any]:
    """A call's input from its arguments text. A call cut short (max_tokens) keeps what was complete,
    read as the SDKs read the streamed input_json_delta fragments (partial JSON, jiter's rules)."""
    if not text.strip():
        return {}
    try:
        value = pydantic_core.from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
