"""The reasoning parsers (kvflow/entrypoints/openai/reasoning_parsers.py) without a server: the whole-text
split of each format, and the streaming parser fed every split of sample texts into 2 and 3 deltas
(its concatenated deltas equal the whole-text split; no piece of a tag ever reaches either side)."""

from __future__ import annotations

import itertools

import pytest

from kvflow.entrypoints.openai.reasoning_parsers import get_reasoning_format

QWEN3 = get_reasoning_format("qwen3")
R1 = get_reasoning_format("deepseek_r1")


@pytest.mark.parametrize(
    "fmt, text, reasoning, content",
    [
        (QWEN3, "<think>abc</think>\n\nthe answer", "abc", "\n\nthe answer"),
        (QWEN3, "<think></think>x", "", "x"),
        (QWEN3, "no thinking here", None, "no thinking here"),
        (QWEN3, "text </think> more", None, "text </think> more"),  # no opening tag: all content
        (QWEN3, " <think>a</think>b", None, " <think>a</think>b"),  # the block must open the output
        (QWEN3, "<think>cut by max_tokens", "cut by max_tokens", ""),  # an unclosed block stays reasoning
        (QWEN3, "<think>a</think>b</think>c", "a", "b</think>c"),
        (QWEN3, "", None, ""),
        (R1, "abc</think>answer", "abc", "answer"),
        (R1, "<think>abc</think>answer", "abc", "answer"),  # a block the model opens itself
        (R1, "all reasoning, never closed", "all reasoning, never closed", ""),
        (R1, "</think>", "", ""),
        (R1, "a<b</thinkc</think>d", "a<b</thinkc", "d"),
    ],
)
def test_split(fmt, text, reasoning, content):
    assert fmt.split(text) == (reasoning, content)


SAMPLES = [
    '<think>a<b</th c</think>\n\n{"x": 1}<',
    "<think></think>ok",
    "<thin",
    "<think",
    "plain answer </think> x",
    "r1 style</think>after",
    "</think></think>",
    "<think>x</thinkk</think>",
    "",
]


def _splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_equals_split_at_every_split_point(fmt, text):
    reasoning, content = fmt.split(text)
    for pieces in _splits(text):
        parser = fmt.streaming()
        got_r, got_c = [], []
        for k, piece in enumerate(pieces):
            r, c = parser.feed(piece, finished=k == len(pieces) - 1)
            got_r.append(r)
            got_c.append(c)
            # what was sent so far never holds a piece of a tag the whole text turns out to use
            if reasoning is not None:
                assert "".join(got_c) == content[: len("".join(got_c))], pieces
                assert "".join(got_r) == reasoning[: len("".join(got_r))], pieces
            else:
                assert "".join(got_c) == content[: len("".join(got_c))], pieces
        assert ("".join(got_r), "".join(got_c)) == (reasoning or "", content), pieces
        assert parser.saw_reasoning == (reasoning is not None)


def test_streaming_holds_back_a_possible_tag():
    parser = QWEN3.streaming()
    assert parser.feed("<th") == ("", "")  # could still be <think>
    assert parser.feed("ink>abc</th") == ("abc", "")  # "</th" could still be </think>
    assert parser.feed("ink>") == ("", "")
    assert parser.feed("{}", finished=True) == ("", "{}")
    parser = R1.streaming()
    assert parser.feed("x</") == ("x", "")
    assert parser.feed("b", finished=True) == ("</b", "")  # not a tag after all: flushed as reasoning


@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_grammar_prefix_accepts_the_think_block_then_the_constraint(fmt):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf(fmt.grammar_prefix()), xgr.Grammar.from_json_schema(schema))
    assert accepts(grammar, '<think>a < b </thin </think>\n\n{"a": 1}')
    assert not accepts(grammar, '<think>a</think>b</think>{"a": 1}')  # reasoning ends at the first end tag
    assert not accepts(grammar, "<think>a</think>not json")
    # qwen3 may skip the block; deepseek_r1's output reasons first (its template opened <think>)
    assert accepts(grammar, '{"a": 1}') == (fmt is QWEN3)
    assert accepts(grammar, 'a</think>{"a": 1}') == (fmt is R1)


def test_unknown_parser():
    assert get_reasoning_format(None) is None
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_format("nope")


def test_tool_calls_are_read_from_the_content_only():
    from types import SimpleNamespace

    from kvflow.entrypoints.openai.serving_chat import _message
    from kvflow.entrypoints.openai.tool_parsers import get_tool_format

    hermes = get_tool_format("hermes", None)
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    out = SimpleNamespace(text=f"<think>maybe {call}</think>{call}", finish_reason="stop")
    message, reason = _message(out, hermes, QWEN3)
    assert reason == "tool_calls" and message["reasoning_content"] == f"maybe {call}"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"] and not message["content"]
    out = SimpleNamespace(text=f"<think>maybe {call}</think>no call", finish_reason="stop")
    message, reason = _message(out, hermes, QWEN3)
    assert reason == "stop" and "tool_calls" not in message and message["content"] == "no call"
