"""Tool calling, text side: parsing each format, streaming that agrees with parsing however the text is
cut, format detection, and structural tags that really make a (tiny, random) model write valid calls."""

from __future__ import annotations

import json
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.entrypoints.openai.tool_parsers import (
    FORMATS,
    TOOL_CALL_PARSERS,
    StreamingToolParser,
    ToolCall,
    generic_system_prompt,
    get_tool_format,
    make_tool_call_id,
)

HERMES, LLAMA, MISTRAL, GENERIC = (FORMATS[n]() for n in ("hermes", "llama3_json", "mistral", "generic"))
CHECKS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(name, args) for name, args in pairs]


# ---- parse() ------------------------------------------------------------------------------------------
def test_hermes_parse():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert HERMES.parse(one).content is None
    assert HERMES.parse(one).tool_calls == calls(("get_weather", '{"city": "Paris"}'))

    two = "Let me check.\n\n" + one + '\n<tool_call>\n{"name": "b", "arguments": {"x": "}{\\"", "y": []}}\n</tool_call>'
    out = HERMES.parse(two)
    assert out.content == "Let me check."
    assert out.tool_calls == calls(("get_weather", '{"city": "Paris"}'), ("b", '{"x": "}{\\"", "y": []}'))

    squashed = '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call><tool_call>{ "name" : "g" ,\n"arguments":\t{} }</tool_call>'
    assert HERMES.parse(squashed).tool_calls == calls(("f", '{"a":1}'), ("g", "{}"))
    # key order, a missing end tag, text around the calls
    odd = 'hi <tool_call>{"arguments": {"a": 1}, "name": "z"}</tool_call> and <tool_call>{"name": "y", "arguments": {}}'
    assert HERMES.parse(odd).content == "hi and"
    assert HERMES.parse(odd).tool_calls == calls(("z", '{"a": 1}'), ("y", "{}"))


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"nam": "f", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        "use <tool_call> tags",
        "a < b and <tool_cal",
    ],
)
def test_hermes_malformed_is_content(text):
    out = HERMES.parse(text)
    assert out.tool_calls == [] and out.content == text


def test_truncated_call_keeps_what_was_written():
    # max_tokens cut the call short: streaming has already announced it, so parse() agrees
    out = HERMES.parse('Sure <tool_call>\n{"name": "f", "arguments": {"q": "abc')
    assert out.content == "Sure" and out.tool_calls == calls(("f", '{"q": "abc'))


@pytest.mark.parametrize(
    "fmt,text,content,expected",
    [
        # cut after the name: the call, with the arguments written so far (none)
        (HERMES, 'Sure <tool_call>\n{"name": "get_weather", "arguments":', "Sure", [("get_weather", "")]),
        (HERMES, '<tool_call>\n{"name": "get_weather", "argu', None, [("get_weather", "")]),
        (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": ', None, [("get_weather", "")]),
        (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g"', None, [("f", "{}"), ("g", "")]),
        (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
        (LLAMA, '{"name": "f", "parameters"', None, [("f", "")]),
        # cut before the name is whole, or in a block's marker, separator or closing: nothing of it
        (HERMES, "Sure <tool_call>", "Sure", []),
        (HERMES, 'Sure <tool_call>\n{"name": "get_wea', "Sure", []),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', None, [("f", "{}")]),
        (GENERIC, '{"tool_', None, []),
        (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {}}]', None, [("f", "{}")]),
        (GENERIC, "{", None, []),
        (LLAMA, '{"na', None, []),
        (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, ', None, [("f", "{}")]),
        # not the opening of a call: content, as before
        (LLAMA, "{oops", "{oops", []),
        (GENERIC, '{"response": "cut', "cut", []),
    ],
)
def test_a_cut_call_is_a_call_never_content(fmt, text, content, expected):
    out = fmt.parse(text)
    assert out.content == content and out.tool_calls == calls(*expected)
    assert_streams_like_parse(fmt, text, range(len(text)))


def test_json_response_is_the_content():
    # generic with response_format: {"response": JSON}, the JSON (as written) is the content
    fmt = GENERIC.with_response_schema({})
    assert fmt.parse('{"response": {"a": "}", "b": [1, 2]} }').content == '{"a": "}", "b": [1, 2]}'
    assert fmt.parse('{"response":\n 42}').content == "42"
    assert fmt.parse('{"response": {"cut": "sh').content == '{"cut": "sh'
    assert fmt.parse('{"tool_calls": [{"name": "f", "arguments": {}}]}').tool_calls == calls(("f", "{}"))
    assert GENERIC.parse('{"response": "x"}').content == "x" and not GENERIC.json_response
    for text in ('{"response": {"a": "}", "b": [1, 2]} }', '{"response": 4', '{"tool_calls": [{"name": "f", "ar'):
        assert_streams_like_parse(fmt, text, range(len(text)))
    # the other formats write the JSON bare: it is content unless it opens like a call
    for f in (HERMES, MISTRAL, LLAMA):
        f = f.with_response_schema({})
        assert f.parse('{"city": "Paris", "n": 3}').content == '{"city": "Paris", "n": 3}'
        assert f.parse('{"city": "Pa').content == '{"city": "Pa'


def test_llama3_parse():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "; {"}}'
    assert LLAMA.parse(text).tool_calls == calls(("f", '{"a": 1}'), ("g", '{"b": "; {"}'))
    assert LLAMA.parse(text).content is None
    assert LLAMA.parse('\n {"name":"f","arguments":{}}\n{"name":"g","parameters":{}}').tool_calls == calls(
        ("f", "{}"), ("g", "{}")
    )
    assert LLAMA.parse('{"type": "function", "name": "f", "parameters": {"x": 1}}').tool_calls == calls(
        ("f", '{"x": 1}')
    )
    for content in ['Hello {"name": "f", "parameters": {}}', '  {"answer": 42}', "<|python_tag|>print(1)", "{oops"]:
        assert LLAMA.parse(content).tool_calls == [] and LLAMA.parse(content).content == content


def test_mistral_parse():
    text = 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    out = MISTRAL.parse(text)
    assert out.content == "ok" and out.tool_calls == calls(("f", '{"a": 1}'), ("g", "{}"))
    assert MISTRAL.parse('[TOOL_CALLS] [ {"name":"f","arguments":{"s":"]"}} ]').tool_calls == calls(("f", '{"s":"]"}'))
    # [TOOL_CALLS] is a special token: decoded without it, the list alone still counts
    assert MISTRAL.parse('[{"name": "f", "arguments": {}}]').tool_calls == calls(("f", "{}"))
    for content in ["[1, 2]", "[TOOL_CALLS] bad", "[link](http://x)", '[TOOL_CALLS][{"name": "f"}]']:
        assert MISTRAL.parse(content).tool_calls == [] and MISTRAL.parse(content).content == content


def test_generic_parse():
    text = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}'
    assert GENERIC.parse(text).tool_calls == calls(("f", '{"a": 1}'), ("g", "{}"))
    assert GENERIC.parse(text).content is None
    spaced = '\n{ "tool_calls" : [\n  { "name" : "f" , "arguments" : { "a" : 1 } }\n] }\n'
    assert GENERIC.parse(spaced).tool_calls == calls(("f", '{ "a" : 1 }'))
    assert GENERIC.parse('{"response": "hi \\u00e9 \\ud83d\\ude00 \\"q\\" \\\\n"}').content == 'hi é 😀 "q" \\n'
    assert GENERIC.parse('{"response": " \\n "}').content is None
    assert GENERIC.parse('{"response": "cut short \\u00').content == "cut short "
    for content in ["plain text", '{"answer": 1}', '{"tool_calls": "no"}']:
        assert GENERIC.parse(content).tool_calls == [] and GENERIC.parse(content).content == content


@pytest.mark.parametrize("fmt", [HERMES, LLAMA, MISTRAL, GENERIC], ids=lambda f: f.name)
def test_history_text_reads_back(fmt):
    history = calls(("get_weather", '{"city": "東京"}'), ('say "hi"', "{}"))
    assert fmt.parse(fmt.history_text(history)).tool_calls == history
    assert fmt.parse(fmt.history_text(calls(("f", "")))).tool_calls == calls(("f", "{}"))
    # arguments that are not JSON go back as a JSON string, so the envelope stays JSON (and is no call)
    assert fmt.parse(fmt.history_text(calls(("f", "not json")))).tool_calls == []


def test_tool_call_ids():
    ids = {make_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# ---- streaming ----------------------------------------------------------------------------------------
def stream(fmt, text: str, cuts) -> tuple[str, list[tuple[str, str]]]:
    """Feed growing prefixes of `text`, check each delta's shape, and return what the client assembles."""
    parser = StreamingToolParser(fmt)
    content, got = "", []
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        delta, entries = parser.feed(text[:end], end == len(text))
        content += delta
        indexes = [e["index"] for e in entries]
        assert len(indexes) == len(set(indexes)), f"two entries for one call in a chunk: {entries}"
        for e in entries:
            if "id" in e:  # a new call: its name complete, its arguments ("" or the first fragment)
                assert e["index"] == len(got) and e["type"] == "function"
                assert re.fullmatch(r"call_[0-9a-f]{24}", e["id"])
                got.append([e["function"]["name"], e["function"]["arguments"]])
            else:  # calls stream one after another
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                assert e["index"] == len(got) - 1 and e["function"]["arguments"]
                got[-1][1] += e["function"]["arguments"]
    assert parser.feed(text, True) == ("", [])
    return content, [tuple(g) for g in got]


def assert_streams_like_parse(fmt, text: str, cuts) -> None:
    expected = fmt.parse(text)
    content, got = stream(fmt, text, cuts)
    assert content == (expected.content or "")
    assert got == [(c.name, c.arguments) for c in expected.tool_calls]


_WS = st.sampled_from(["", " ", "\n", "  ", "\t", " \n "])
_NAMES = st.sampled_from(["get_weather", "f", 'say "hi"', "東京_lookup", "a\\b", "x{y}", "<tool_call>"])
_CHARS = st.sampled_from(
    list('ab Z09"\\{}[]:,;/\n\t')
    + ["é", "世", "🚀", "\u2028", "\x00", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", '"}']
)
_STRINGS = st.lists(_CHARS, max_size=5).map("".join)
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-999, 999)
    | st.floats(width=32, allow_nan=False, allow_infinity=False)
    | _STRINGS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_STRINGS, inner, max_size=3),
    max_leaves=6,
)
_ARGUMENTS = st.builds(
    lambda obj, ascii_only, indent, seps: json.dumps(obj, ensure_ascii=ascii_only, indent=indent, separators=seps),
    st.dictionaries(_STRINGS, _VALUES, max_size=3),
    st.booleans(),
    st.sampled_from([None, 2]),
    st.sampled_from([None, (",", ":"), (", ", ": ")]),
)
# text that cannot form a marker or a call by itself
_CONTENT = st.lists(st.sampled_from(list("ab Z.,!?'\n:;\"}]") + ["é", "世界", "🚀", "\u3000"]), max_size=8).map("".join)


@st.composite
def envelopes(draw, key: str) -> tuple[str, ToolCall]:
    """One `{"name": ..., key: {...}}` object with whitespace here and there; sometimes keys swapped."""
    name, args = draw(_NAMES), draw(_ARGUMENTS)
    jname = json.dumps(name, ensure_ascii=draw(st.booleans()))
    w = [draw(_WS) for _ in range(8)]
    fields = [f'"name"{w[0]}:{w[1]}{jname}', f'"{key}"{w[2]}:{w[3]}{args}']
    if draw(st.integers(0, 4)) == 0:
        fields.reverse()
    return "{" + w[4] + f"{w[5]},{w[6]}".join(fields) + w[7] + "}", ToolCall(name, args)


def _joined(draw, parts: list[str], sep: str) -> str:
    return "".join(p + (draw(_WS) + sep + draw(_WS) if i < len(parts) - 1 else "") for i, p in enumerate(parts))


@st.composite
def hermes_texts(draw) -> tuple[str, list[ToolCall]]:
    parts, expected = [], []
    for kind in draw(st.lists(st.sampled_from(["content", "call", "call"]), max_size=4)):
        if kind == "content":
            parts.append(draw(_CONTENT))
        else:
            env, call = draw(envelopes("arguments"))
            parts.append("<tool_call>" + draw(_WS) + env + draw(_WS) + "</tool_call>")
            expected.append(call)
    return draw(st.sampled_from(["", "\n"])).join(parts), expected


@st.composite
def mistral_texts(draw) -> tuple[str, list[ToolCall]]:
    envs = draw(st.lists(envelopes("arguments"), min_size=1, max_size=3))
    before = draw(_CONTENT)
    # a bare list only counts at the very start (after JSON whitespace)
    marker = "[TOOL_CALLS]" if before.strip(" \t\n\r") or draw(st.booleans()) else ""
    body = marker + draw(_WS) + "[" + draw(_WS) + _joined(draw, [e for e, _ in envs], ",") + draw(_WS) + "]"
    return before + body + draw(_CONTENT), [c for _, c in envs]


@st.composite
def llama_texts(draw) -> tuple[str, list[ToolCall]]:
    if draw(st.integers(0, 3)) == 0:
        return draw(_CONTENT), []
    envs = draw(st.lists(envelopes(draw(st.sampled_from(["parameters", "arguments"]))), min_size=1, max_size=3))
    head = draw(_WS) + draw(st.sampled_from(["", "<|python_tag|>"])) + draw(_WS)
    return head + _joined(draw, [e for e, _ in envs], draw(st.sampled_from([";", ";", ""]))), [c for _, c in envs]


@st.composite
def generic_texts(draw) -> tuple[str, list[ToolCall]]:
    w = [draw(_WS) for _ in range(8)]
    if draw(st.booleans()):
        said = draw(_STRINGS)
        return (
            w[0]
            + "{"
            + w[1]
            + '"response"'
            + w[2]
            + ":"
            + w[3]
            + json.dumps(said, ensure_ascii=draw(st.booleans()))
            + w[4]
            + "}"
        ), said
    envs = draw(st.lists(envelopes("arguments"), min_size=1, max_size=3))
    return (
        w[0]
        + "{"
        + w[1]
        + '"tool_calls"'
        + w[2]
        + ":"
        + w[3]
        + "["
        + _joined(draw, [e for e, _ in envs], ",")
        + w[4]
        + "]"
        + w[5]
        + "}"
        + w[6]
    ), [c for _, c in envs]


WELL_FORMED = {
    "hermes": hermes_texts(),
    "mistral": mistral_texts(),
    "llama3_json": llama_texts(),
    "generic": generic_texts(),
}
# anything at all: markers, pieces of markers and of calls, broken escapes, whole calls, cut anywhere
_SCRAPS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "</tool_",
        "[TOOL_CALLS]",
        "[TOOL",
        "<|python_tag|>",
        "<|py",
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ",",
        ";",
        ":",
        " ",
        "\n",
        '"name"',
        '"arguments"',
        '"parameters"',
        '"response"',
        '"tool_calls"',
        '{"name": "f", "arguments": {',
        '{"name": "g", "parameters": {"q": "',
        '{"response": "',
        '{"tool_calls": [',
        "\\u00e9",
        "\\ud83d",
        "\\ude80",
        "\\u12",
        '\\"',
        "é",
        "🚀",
        "text",
    ]
)


@st.composite
def any_texts(draw, fmt_name: str) -> str:
    pieces = draw(st.lists(st.one_of(_SCRAPS, _CONTENT, WELL_FORMED[fmt_name].map(lambda t: t[0])), max_size=8))
    text = "".join(pieces)
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text  # max_tokens, or not


_CUTS = st.lists(st.integers(0, 400), max_size=25)


@pytest.mark.parametrize("name", list(WELL_FORMED))
@CHECKS
@given(data=st.data())
def test_well_formed_output_parses_and_streams(name, data):
    fmt = FORMATS[name]()
    text, expected = data.draw(WELL_FORMED[name])
    out = fmt.parse(text)
    if isinstance(expected, str):  # generic's response
        assert out.tool_calls == [] and out.content == (expected if expected.strip() else None)
    else:
        assert out.tool_calls == expected
    for c in out.tool_calls:
        json.loads(c.arguments)
    assert_streams_like_parse(fmt, text, data.draw(_CUTS))


@pytest.mark.parametrize("name", list(WELL_FORMED))
@CHECKS
@given(data=st.data())
def test_any_output_streams_like_parse(name, data):
    fmt = FORMATS[name]()
    text = data.draw(any_texts(name))
    assert_streams_like_parse(fmt, text, data.draw(_CUTS))


@pytest.mark.parametrize(
    "fmt,text",
    [
        (
            HERMES,
            'Sure thing.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "note": "a \\"}\\" b"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        ),
        (HERMES, "a <tool_call>oops</tool_call> b <tool_cal"),
        (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}; {"arguments": {}, "name": "g"}'),
        (MISTRAL, 'x [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {"b": 2}}] y'),
        (GENERIC, '{"response": "caf\\u00e9 \\ud83d\\ude80 \\"quoted\\" {braces}"}'),
        (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"a": "\\\\"}}, {"name": "g", "arguments": {}}]}'),
    ],
)
def test_every_prefix(fmt, text):
    assert_streams_like_parse(fmt, text, range(len(text)))


def test_streaming_holds_back_what_is_undecided():
    p = StreamingToolParser(HERMES)
    assert p.feed("Hello <tool", False) == ("Hello", [])
    assert p.feed('Hello <tool_call>\n{"name": "get_wea', False) == ("", [])  # no half names
    content, deltas = p.feed('Hello <tool_call>\n{"name": "get_weather", "arguments": {"ci', False)
    # one entry for the call: its header and its first fragment together
    assert content == "" and len(deltas) == 1
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert p.tool_call_ids == [deltas[0]["id"]]
    assert p.feed('Hello <tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>', True) == (
        "",
        [{"index": 0, "function": {"arguments": 'ty": "P"}'}}],
    )

    p = StreamingToolParser(GENERIC)
    assert p.feed('{"response": "caf\\u00', False) == ("caf", [])
    assert p.feed('{"response": "caf\\u00e9!"}', True) == ("é!", [])

    p = StreamingToolParser(LLAMA)
    assert p.feed("  ", False) == ("", [])
    assert p.feed("  Hi", False) == ("  Hi", [])


# ---- choosing a format --------------------------------------------------------------------------------
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    '{{- tool | tojson }}{%- endfor %}{{- \'</tools>\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call>\' }}{%- endif %}'
)
MISTRAL_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
LLAMA31_TEMPLATE = "{%- if builtin_tools is defined %}<|python_tag|>{%- endif %}{{ tools }}"
LLAMA32_TEMPLATE = (
    '{%- if tools is not none %}Respond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.{%- endif %}"
)


@pytest.mark.parametrize(
    "template,expected",
    [
        (QWEN_TEMPLATE, "hermes"),
        (MISTRAL_TEMPLATE, "mistral"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "generic"),
        (None, "generic"),
    ],
)
def test_auto_picks_from_the_template(template, expected):
    fmt = get_tool_format("auto", template)
    assert fmt.name == expected and fmt.uses_template_tools == (expected != "generic")


def test_named_formats():
    assert set(FORMATS) == set(TOOL_CALL_PARSERS) - {"auto"}
    for name in FORMATS:
        assert get_tool_format(name, QWEN_TEMPLATE).name == name
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*generic"):
        get_tool_format("qwen", None)


# ---- constraining -------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "東京", 'Quote"Town']},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
SAY = {
    "type": "function",
    "function": {
        "name": 'say "hi"',
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["text"],
            "properties": {"text": {"type": "string", "pattern": "^[a-z ]{0,6}$"}, "loud": {"type": "boolean"}},
        },
    },
}
NOW = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
TOOLS = [WEATHER, SAY, NOW]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def grammar():
    xgr = pytest.importorskip("xgrammar")
    torch = pytest.importorskip("torch")
    sys.path.insert(0, "tests")
    from conftest import make_tokenizer

    tok = make_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=512, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info)
    pieces = [tok.decode([i]) for i in range(len(tok))]
    quote_tokens = [i for i, p in enumerate(pieces) if '"' in p]
    space_tokens = [i for i, p in enumerate(pieces) if p and p.isspace()]

    def walk(tag: dict, seed: int, prefix: str = "", short_strings: bool = False) -> str:
        """Random logits, masked by the grammar, sampled until the grammar ends (a random model)."""
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        assert not prefix or matcher.accept_string(prefix)
        bitmask = xgr.allocate_token_bitmask(1, 512)
        gen = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        while not matcher.is_terminated():
            assert len(ids) < 600, tok.decode(ids)
            matcher.fill_next_token_bitmask(bitmask)
            logits = torch.randn(1, 512, generator=gen)
            logits[0, space_tokens] -= 1.5  # JSON allows any run of whitespace; a model rarely wants one
            if short_strings:  # an unbounded string would otherwise go on for long
                logits[0, quote_tokens] += 2.5
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            if token != 1:
                ids.append(token)
        return prefix + tok.decode(ids, skip_special_tokens=False)

    def accepts(tag: dict, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return matcher.accept_string(text) and matcher.accept_token(1) and matcher.is_terminated()

    return walk, accepts


def check_calls(fmt, text: str, parallel: bool, named: str | None) -> None:
    import jsonschema

    out = fmt.parse(text)
    assert out.tool_calls, text
    if not parallel or named:  # a named choice is one call, whatever parallel_tool_calls says
        assert len(out.tool_calls) == 1, text
    for call in out.tool_calls:
        assert call.name == named if named else call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json", "generic"])
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_constrained_output_is_a_valid_call(grammar, name, choice, parallel):
    walk, _ = grammar
    fmt = FORMATS[name]()
    named = 'say "hi"' if choice == "named" else None
    tag = fmt.structural_tag(
        TOOLS, {"type": "function", "function": {"name": named}} if named else "required", parallel
    )
    for seed in range(3):
        text = walk(tag, seed)
        check_calls(fmt, text, parallel, named)
        assert fmt.parse(text).content is None
        if name == "generic":
            json.loads(text)


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA, GENERIC], ids=lambda f: f.name)
def test_named_is_one_call_and_required_may_end_after_any(grammar, fmt):
    _, accepts = grammar
    one = fmt.history_text(calls(("now", "{}")))
    two = fmt.history_text(calls(("now", "{}"), ("now", "{}")))
    named = fmt.structural_tag(TOOLS, {"type": "function", "function": {"name": "now"}}, True)
    assert accepts(named, one) and not accepts(named, two)
    required = fmt.structural_tag(TOOLS, "required", True)
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(fmt.structural_tag(TOOLS, "required", False), two)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA, GENERIC], ids=lambda f: f.name)
def test_auto_with_a_response_schema_is_calls_or_the_schema(grammar, fmt):
    import jsonschema

    walk, accepts = grammar
    tag = fmt.structural_tag(TOOLS, "auto", True, response_schema=PERSON)
    fmt = fmt.with_response_schema(PERSON)
    answer = '{"name": "Bo", "age": 3}'
    written = '{"response": ' + answer + "}" if fmt.name == "generic" else answer
    assert accepts(tag, written) and fmt.parse(written).content == answer and not fmt.parse(written).tool_calls
    assert accepts(tag, fmt.history_text(calls(("now", "{}"))))
    assert not accepts(tag, "Hello there.") and not accepts(tag, written.replace('"age": 3', '"age": -3'))
    kinds = set()
    for seed in range(6):
        out = fmt.parse(walk(tag, seed, short_strings=True))
        if out.tool_calls:
            kinds.add("calls")
        else:
            jsonschema.validate(json.loads(out.content), PERSON)
            kinds.add("json")
    assert kinds  # both kinds are possible; which ones a random walk takes is its own business
    # a choice that demands a call leaves the schema nothing to shape
    assert fmt.structural_tag(TOOLS, "required", True, response_schema=PERSON) == fmt.structural_tag(
        TOOLS, "required", True
    )


def test_generic_auto_is_calls_or_a_response(grammar):
    walk, accepts = grammar
    tag = GENERIC.structural_tag(TOOLS, "auto", True)
    kinds = set()
    for seed in range(8):
        text = walk(tag, seed, short_strings=True)
        out, whole = GENERIC.parse(text), json.loads(text)
        if out.tool_calls:
            check_calls(GENERIC, text, True, None)
            kinds.add("calls")
        else:
            assert out.content == (whole["response"] if whole["response"].strip() else None)
            kinds.add("response")
    assert kinds == {"calls", "response"}
    assert not accepts(tag, "plain text") and not accepts(tag, '{"response": 1}')


@pytest.mark.parametrize("fmt,start", [(HERMES, "Let me look.\n<tool_call>"), (MISTRAL, "[TOOL_CALLS]"), (LLAMA, "{")])
def test_auto_constrains_a_call_once_it_starts(grammar, fmt, start):
    walk, accepts = grammar
    tag = fmt.structural_tag(TOOLS, "auto", False)
    for seed in range(3):
        check_calls(fmt, walk(tag, seed, prefix=start), False, None)
    assert accepts(tag, "Hello there.")
    assert accepts(tag, fmt.history_text(calls(("get_weather", '{"city": "Paris"}'))))
    assert not accepts(tag, fmt.history_text(calls(("get_weather", '{"city": "Rome"}'))))
    assert not accepts(tag, fmt.history_text(calls(("nope", "{}"))))
    assert not accepts(tag, fmt.history_text(calls(("now", "{}"), ("now", "{}"))))  # parallel=False


def test_structural_tag_shapes_and_errors():
    assert HERMES.structural_tag(TOOLS, "auto", True)["format"]["type"] == "triggered_tags"
    named = MISTRAL.structural_tag(TOOLS, {"type": "function", "function": {"name": 'say "hi"'}}, False)["format"]
    assert [e["type"] for e in named["elements"]] == ["const_string", "tags_with_separator", "const_string"]
    (tag,) = named["elements"][1]["tags"]
    assert tag["begin"] == '{"name": "say \\"hi\\"", "arguments": ' and named["elements"][1]["stop_after_first"]
    bare = HERMES.structural_tag([{"type": "function", "function": {"name": "f"}}], "required", True)
    assert bare["format"]["tags"][0]["content"]["json_schema"] == {"type": "object"}
    assert HERMES.structural_tag([], "auto", True) is None
    with pytest.raises(ValueError, match="missing"):
        HERMES.structural_tag(TOOLS, {"type": "function", "function": {"name": "missing"}}, True)
    with pytest.raises(ValueError, match="parameters"):
        GENERIC.structural_tag([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", True)
    with pytest.raises(ValueError, match="tool_choice"):
        LLAMA.structural_tag(TOOLS, "sometimes", True)
    with pytest.raises(ValueError):
        LLAMA.structural_tag([], "required", True)


def test_generic_system_prompt():
    auto = generic_system_prompt(TOOLS, "auto", True)
    assert '"get_weather"' in auto and "Weather now" in auto and '{"response": ' in auto and "several" in auto
    required = generic_system_prompt(TOOLS, "required", False)
    assert "must call" in required and '{"response"' not in required and "exactly one" in required
    named = generic_system_prompt(TOOLS, {"type": "function", "function": {"name": "now"}}, True)
    assert 'tool "now"' in named and '{"name": "now"' in named and "exactly one" in named
    schema = generic_system_prompt(TOOLS, "auto", True, response_schema=PERSON)
    assert json.dumps(PERSON) in schema and '{"response": <the answer>}' in schema
