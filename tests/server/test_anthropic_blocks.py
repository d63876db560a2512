"""Messages content blocks from output text (no server): the blocks written by hand for each case, the
same blocks however a stream cuts the text, and stream events that assemble, as Anthropic's SDKs do
(jiter's partial JSON for tool input), into exactly the non-streamed content."""

from __future__ import annotations

import json

import jiter
import pytest

from kvflow.entrypoints.anthropic.blocks import ContentBlocks, event_source, events_of
from kvflow.entrypoints.openai.tool_parsers import FORMATS

HERMES, GENERIC = FORMATS["hermes"](), FORMATS["generic"]()
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
WEATHER = {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}

CASES = [
    (None, "Hello there", [{"type": "text", "text": "Hello there"}]),
    (None, "", []),
    (HERMES, "Just text.", [{"type": "text", "text": "Just text."}]),
    (HERMES, CALL, [WEATHER]),
    (
        HERMES,
        f"Sure.\n{CALL}\nDone.",
        [{"type": "text", "text": "Sure."}, WEATHER, {"type": "text", "text": "Done."}],
    ),
    (HERMES, f"{CALL}\n{CALL}", [WEATHER, WEATHER]),
    (  # cut by max_tokens inside the arguments: what was complete
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel',
        [{"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}],
    ),
    (
        GENERIC,
        '{"tool_calls": [{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}]}',
        [{"type": "tool_use", "name": "f", "input": {"a": [1, 2]}}, {"type": "tool_use", "name": "g", "input": {}}],
    ),
    (GENERIC, '{"response": "hello \\"you\\""}', [{"type": "text", "text": 'hello "you"'}]),
]


def _fold(events) -> tuple[list[dict], list[dict]]:
    blocks = ContentBlocks()
    stream = [e for event in events for e in blocks.add(event)]
    return blocks.content(), stream + blocks.close()


def _without_ids(content: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def _assembled(stream: list[dict]) -> list[dict]:
    """What a client builds from the events (the anthropic SDK's accumulate_event, in short), checking
    that blocks come one after another: start, deltas of that block, stop."""
    content, json_text, open_index = [], {}, None
    for e in stream:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(content)
            open_index = e["index"]
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            delta = e["delta"]
            if delta["type"] == "text_delta":
                content[open_index]["text"] += delta["text"]
            else:
                json_text[open_index] = json_text.get(open_index, "") + delta["partial_json"]
                content[open_index]["input"] = jiter.from_json(json_text[open_index].encode(), partial_mode=True)
        else:
            assert e == {"type": "content_block_stop", "index": open_index}
            open_index = None
    assert open_index is None
    return content


@pytest.mark.parametrize("fmt,text,expected", CASES)
def test_blocks_from_text(fmt, text, expected):
    content, stream = _fold(events_of(fmt, text))
    assert _without_ids(content) == expected
    assert _assembled(stream) == content
    ids = [b["id"] for b in content if b["type"] == "tool_use"]
    assert len(set(ids)) == len(ids) and all(i.startswith("toolu_") for i in ids)


@pytest.mark.parametrize("fmt,text,expected", CASES)
def test_every_cut_gives_the_same_blocks(fmt, text, expected):
    for step in (1, 2, 3, 7):
        source = event_source(fmt)
        events = [e for end in range(step, len(text), step) for e in source.feed(text[:end], False)]
        events += source.feed(text, True)
        content, stream = _fold(events)
        assert _without_ids(content) == expected, step
        assert _assembled(stream) == content


def test_text_deltas_and_json_fragments_are_the_text_itself():
    _, stream = _fold(events_of(HERMES, f"Sure.\n{CALL}"))
    fragments = "".join(e["delta"].get("partial_json", "") for e in stream if e["type"] == "content_block_delta")
    assert json.loads(fragments) == WEATHER["input"] and fragments == json.dumps(WEATHER["input"])
