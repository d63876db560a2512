"""Tool calling, text side: model output -> OpenAI `tool_calls` (streamed or not), and the xgrammar
structural tag that makes the model write a call when `tool_choice` demands one.

Each ToolCallFormat says how one family of chat templates writes calls (hermes, llama3_json, mistral),
plus `generic`, kvflow's own JSON protocol for templates that know nothing about tools. One incremental
reader (_CallScanner) understands all of them. `parse()` runs it once over the finished text and
StreamingToolParser feeds it growing prefixes; it only moves past text once no continuation could change
what that text means, so the streamed and the non-streamed answers agree however the text is cut.

What counts as a call: the opening of one, written out far enough to fix its name and the start of its
arguments object (`{"name": "NAME", "arguments": {` with any JSON whitespace), or a complete JSON object
with a "name" string and an "arguments" object in any key order. Once the opening is seen the call is
committed, because streaming has already announced it; its arguments are then the raw text of the
object, up to its matching brace, or to the end if the output stopped inside it. As in OpenAI's API,
arguments are the model's text, not checked JSON. Anything else stays content, verbatim.

A call cut by the end of the output (`length`, a stop string, an abort) is reported one way, as OpenAI
does: in `tool_calls`, with its arguments as far as the model wrote them (so not valid JSON), and the
request's own finish_reason. Its raw text never becomes content. A call cut before its name was
complete has nothing to report and is dropped, as is a half-written marker or separator of a block of
calls: with tools the output always follows the tool grammar, so text inside a block can only be a call.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass

from kvflow.config import TOOL_CALL_PARSERS


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments JSON object exactly as the model wrote it


@dataclass
class ParsedOutput:
    content: str | None  # text that is not a tool call; None when empty / whitespace only
    tool_calls: list[ToolCall]


def make_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---- reading JSON-ish text that may still be growing ------------------------------------------------------
class _NeedMore(Exception):
    """The text ends before a decision can be made: wait for more of it."""


_WS = " \t\n\r"  # JSON's whitespace, which is all a format allows between its tokens
_STRING_BODY = re.compile(r'[^"\\]*')
_OUTSIDE_STRING = re.compile(r'[^"{}\[\]]*')


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _starts(text: str, i: int, literal: str, final: bool) -> bool:
    """Whether `literal` is at text[i:]. Raises _NeedMore while the text ends inside a prefix of it."""
    chunk = text[i : i + len(literal)]
    if chunk == literal:
        return True
    if len(chunk) < len(literal) and literal.startswith(chunk) and not final:
        raise _NeedMore
    return False


def _string_end(text: str, i: int, final: bool) -> int | None:
    """text[i] is '"': the index just past the closing quote (None: unterminated, at the end)."""
    n, j = len(text), i + 1
    while True:
        j = _STRING_BODY.match(text, j).end()
        if j >= n:
            break
        if text[j] == '"':
            return j + 1
        j += 2  # a backslash and the character it escapes
        if j > n:
            break
    if final:
        return None
    raise _NeedMore


class _Cursor:
    """Reads whitespace-separated JSON tokens from text[i:]; each test raises _NeedMore while undecided."""

    def __init__(self, text: str, i: int, final: bool) -> None:
        self.text, self.i, self.final = text, i, final

    def lit(self, *options: str) -> bool:
        self.i = _skip_ws(self.text, self.i)
        undecided = False
        for option in options:
            try:
                if _starts(self.text, self.i, option, self.final):
                    self.i += len(option)
                    return True
            except _NeedMore:
                undecided = True
        if undecided:
            raise _NeedMore
        return False

    def string(self) -> str | None:
        self.i = start = _skip_ws(self.text, self.i)
        if not self.lit('"'):
            return None
        end = _string_end(self.text, start, self.final)
        if end is None:
            return None
        try:
            value = json.loads(self.text[start:end])
        except ValueError:
            return None
        self.i = end
        return value


class _Brackets:
    """Finds where a JSON value's brackets balance, resumably: feed it more text as it arrives. It knows
    strings (a brace inside "..." does not count) and nothing else, which is all it takes to cut a raw
    value out of the text without judging it."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escaped = depth, False, False

    def scan(self, text: str, i: int) -> int | None:
        """Consume text[i:]; the index just past the bracket that balances, or None (all consumed)."""
        n = len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped, i = False, i + 1
                    continue
                i = _STRING_BODY.match(text, i).end()
                if i >= n:
                    break
                if text[i] == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
                i += 1
            else:
                i = _OUTSIDE_STRING.match(text, i).end()
                if i >= n:
                    break
                c = text[i]
                i += 1
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth <= 0:
                        return i
        return None


def _member_spans(text: str, i: int) -> dict[str, tuple[int, int]]:
    """Where each member value of the (valid, complete) JSON object at text[i] lies in the text."""
    decoder, spans = json.JSONDecoder(), {}
    j = _skip_ws(text, i + 1)
    while text[j] != "}":
        key, j = decoder.raw_decode(text, j)
        j = _skip_ws(text, _skip_ws(text, j) + 1)  # past the ':'
        _, end = decoder.raw_decode(text, j)
        spans[key] = (j, end)  # a repeated key: the last one wins, as in json.loads
        j = _skip_ws(text, end)
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
    return spans


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _hex4(s: str) -> int | None:
    return int(s, 16) if len(s) == 4 and all(c in _HEX for c in s) else None


def _could_become(partial: str, pattern: tuple[str, ...]) -> bool:
    """Whether `partial` (shorter than `pattern`) may still grow into it; pattern[k] = allowed chars."""
    return all(c in allowed for c, allowed in zip(partial, pattern))


_HEX_ESCAPE = ("\\", "u", *[_HEX] * 4)
_LOW_SURROGATE_ESCAPE = ("\\", "u", "dD", "cdefCDEF", _HEX, _HEX)


def _unescape(text: str, i: int) -> tuple[str, int] | None:
    """text[i] is a backslash inside a JSON string: (what it stands for, how many chars it spans), or
    None while the text ends inside it. Lenient: a bad escape stands for the escaped char itself and a
    lone surrogate for U+FFFD, so model output never raises."""
    rest = text[i : i + 6]
    if len(rest) < 2:
        return None
    if rest[1] != "u":
        return _ESCAPES.get(rest[1], rest[1]), 2
    code = _hex4(rest[2:])
    if code is None:
        return None if len(rest) < 6 and _could_become(rest, _HEX_ESCAPE) else ("u", 2)
    if 0xD800 <= code < 0xDC00:  # a high surrogate: the pair's low half should follow
        low = text[i + 6 : i + 12]
        if len(low) < 6 and _could_become(low, _LOW_SURROGATE_ESCAPE):
            return None
        low_code = _hex4(low[2:]) if low[:2] == "\\u" else None
        if low_code is not None and 0xDC00 <= low_code < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low_code - 0xDC00)), 12
        return "\ufffd", 6
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", 6
    return chr(code), 6


def _match_head(text: str, i: int, keys: tuple[str, ...], final: bool) -> tuple[str, int] | None:
    """`{"name": NAME, "arguments": {` at text[i:], any JSON whitespace between the tokens: (the name,
    the index of the arguments' `{`); None when the text is something else."""
    c = _Cursor(text, i, final)
    if not (c.lit("{") and c.lit('"name"') and c.lit(":")):
        return None
    name = c.string()
    if not name or not (c.lit(",") and c.lit(*keys) and c.lit(":") and c.lit("{")):
        return None
    return name, c.i - 1


def _head_name(text: str, i: int) -> str | None:
    """The name of a call whose opening the output ends inside (`{"name": "NAME", "argu`), or None when
    the text ends before the name is complete."""
    c = _Cursor(text, i, final=False)
    try:
        if c.lit("{") and c.lit('"name"') and c.lit(":"):
            return c.string() or None
    except _NeedMore:
        pass
    return None


class _Content:
    """Content as parse() defines it: the text outside the calls, less the whitespace at its edges next
    to a call ("Sure.\n<tool_call>..." gives "Sure."), or nothing when it is whitespace only.
    Whitespace is held back until it is known to be content."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.pending = ""  # trailing whitespace, not yet known to be content
        self.gap = False  # pending lies between content and a call: content only if more content follows
        self.after_call = False  # a call just ended: leading whitespace goes
        self.started = False  # something other than whitespace was emitted

    def text(self, s: str) -> None:
        if self.after_call:
            s = s.lstrip()
            if not s:
                return
            self.after_call = False
        body = s.rstrip()
        if not body:
            self.pending += s
            return
        self.events.append(("content", self.pending + body))
        self.started, self.pending, self.gap = True, s[len(body) :], False

    def call(self) -> None:
        if not self.started:  # whitespace before the first call is not content
            self.pending = ""
        self.gap = self.after_call = True

    def end_response(self) -> None:
        self.finish()  # the generic {"response": ...} string is content in full
        self.after_call = True

    def end_value(self) -> None:
        """The end of generic's {"response": JSON}: whitespace around the JSON value is not content."""
        self.pending = ""
        self.after_call = True

    def finish(self) -> None:
        if self.started and self.pending and not self.gap:
            self.events.append(("content", self.pending))
        self.pending = ""


class _CallScanner:
    """The reader behind parse() and StreamingToolParser: a state machine over the output text, which
    emits ("content", text), ("call", index, name) and ("args", index, fragment) events."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text, self.final, self.pos = "", False, 0
        self.state = "start" if fmt.start_markers else "text"
        self.after_block = "text" if fmt.markers else "plain"
        self.content = _Content()
        self.calls: list[tuple[str, list[str]]] = []  # (name, argument fragments)
        # The block of calls being read: where it began and with which marker, so that one holding no
        # call can be re-read as text (nothing of it was emitted yet).
        self.block_start, self.block_marker, self.block_calls = 0, "", 0
        self.brackets = _Brackets()
        self.whole: tuple[int, _Brackets, int] | None = None  # resumable scan of a key-order-free call

    def advance(self, text: str, final: bool) -> list[tuple]:
        if len(text) < len(self.text):
            raise ValueError("the output text must only grow")
        self.text, self.final = text, False
        self.content.events = events = []
        self._run()
        if final:
            # Read as far as a longer text would be read first, so that parse() and the last feed of a
            # stream meet the end of the output in the same state; then decide what is left.
            if self.state in _CALL_STATES:
                self._cut()
            self.final = True
            self._run()
            self.content.finish()
        return events

    def _run(self) -> None:
        while True:
            try:
                if not getattr(self, "_" + self.state)():
                    break
            except _NeedMore:  # raised before a step changes anything, so the next feed retries it
                break

    def _cut(self) -> None:
        """The output ended inside a block of calls: report the cut call if its name is complete (its
        arguments, as far as they were written, went out already); drop the rest of the block's text."""
        if self.state == "element":
            i = _skip_ws(self.text, self.pos)
            try:
                if _match_head(self.text, i, self.fmt.arguments_keys, final=False) is None:
                    return  # no call's opening (JSON content, say): the final read decides what it is
            except _NeedMore:  # the text ends inside what can only be a call's opening
                pass
            name = _head_name(self.text, i)
            if name is not None:
                self._begin_call(name)
        if self.state not in ("response", "response_value"):  # an answer's own text is content to its end
            self.content.gap = True  # whitespace before the dropped block is not content either
        self.pos, self.state = len(self.text), "end"

    # ---- bookkeeping -----------------------------------------------------------------------------------
    def _open_block(self, start: int, marker: str, pos: int) -> None:
        self.block_start, self.block_marker, self.block_calls = start, marker, 0
        self.pos, self.state = pos, "open"

    def _fail(self, at: int) -> bool:
        """The text at `at` does not go on as the block of calls it was in."""
        if self.block_calls:  # the block ends here; what follows is ordinary text
            self.pos, self.state = at, self.after_block
        elif self.block_marker:  # the marker was just text
            self.content.text(self.block_marker)
            self.pos, self.state = self.block_start + len(self.block_marker), "text"
        else:  # the output does not start with calls: it is all text
            self.pos, self.state = 0, self.after_block
        return True

    def _begin_call(self, name: str) -> None:
        self.content.call()
        self.block_calls += 1
        self._emit(("call", len(self.calls), name))
        self.calls.append((name, []))

    def _args(self, fragment: str) -> None:
        self.calls[-1][1].append(fragment)
        self._emit(("args", len(self.calls) - 1, fragment))

    def _emit(self, event: tuple) -> None:
        self.content.events.append(event)

    # ---- states: each returns whether to keep going ---------------------------------------------------
    def _start(self) -> bool:  # a block of calls that may only open the output
        markers = [m for m in self.fmt.start_markers if m]
        c = _Cursor(self.text, 0, self.final)
        if not (markers and c.lit(*markers)) and "" not in self.fmt.start_markers:
            return self._fail(0)
        self._open_block(0, "", c.i)
        return True

    def _text(self) -> bool:  # free text, which may hold markers
        text, pos, first = self.text, self.pos, None
        for marker in self.fmt.markers:
            k = text.find(marker, pos)
            if k >= 0 and (first is None or k < first[0]):
                first = (k, marker)
        if first is not None:
            k, marker = first
            self.content.text(text[pos:k])
            self._open_block(k, marker, k + len(marker))
            return True
        stop = len(text) if self.final else len(text) - _marker_prefix_len(text, pos, self.fmt.markers)
        self.content.text(text[pos:stop])
        self.pos = stop
        return False

    def _end(self) -> bool:  # a cut block: nothing more is read
        return False

    def _plain(self) -> bool:  # text to the end, no markers
        self.content.text(self.text[self.pos :])
        self.pos = len(self.text)
        return False

    def _open(self) -> bool:  # the tokens between a block's marker and its first call
        c = _Cursor(self.text, self.pos, self.final)
        if all(c.lit(token) for token in self.fmt.block_open):
            self.pos, self.state = c.i, "element"
            return True
        opening = self.fmt.json_response_open if self.fmt.json_response else self.fmt.response_open
        if opening:
            c = _Cursor(self.text, self.pos, self.final)
            if all(c.lit(token) for token in opening):
                self.pos, self.state = c.i, "response_value_start" if self.fmt.json_response else "response"
                return True
        return self._fail(self.pos)

    def _element(self) -> bool:  # one call
        i = _skip_ws(self.text, self.pos)
        head = _match_head(self.text, i, self.fmt.arguments_keys, self.final)
        if head is not None:
            name, self.pos = head
            self._begin_call(name)
            self.brackets, self.state = _Brackets(), "arguments"
            return True
        whole = self._whole_call(i)
        if whole is None:
            return self._fail(i)
        name, (a, b), end = whole
        self._begin_call(name)
        self._args(self.text[a:b])
        self.pos, self.state = end, "after"
        return True

    def _whole_call(self, i: int) -> tuple[str, tuple[int, int], int] | None:
        """A complete JSON object at text[i] that is a call with its keys in another order."""
        text = self.text
        if i >= len(text) or text[i] != "{":
            if i >= len(text) and not self.final:
                raise _NeedMore
            return None
        if self.whole is None or self.whole[0] != i:
            self.whole = (i, _Brackets(), i)
        _, brackets, scanned = self.whole
        end = brackets.scan(text, scanned)
        if end is None:
            self.whole = (i, brackets, len(text))  # only caches the scan: retrying later is the same
            if self.final:
                return None
            raise _NeedMore
        try:
            obj = json.loads(text[i:end])
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        for key in self.fmt.arguments_keys:
            if isinstance(obj.get(key[1:-1]), dict):
                return obj["name"], _member_spans(text, i)[key[1:-1]], end
        return None

    def _arguments(self) -> bool:  # inside the arguments object: pass it through as it comes
        end = self.brackets.scan(self.text, self.pos)
        stop = len(self.text) if end is None else end
        if stop > self.pos:
            self._args(self.text[self.pos : stop])
            self.pos = stop
        if end is None:
            return False
        self.state = "element_end"
        return True

    def _element_end(self) -> bool:  # after the arguments: the call object's own closing brace
        i = _skip_ws(self.text, self.pos)
        if i == len(self.text):
            if self.final:
                return False
            raise _NeedMore
        c = self.text[i]
        if c == "}":
            self.pos, self.state = i + 1, "after"
        elif c == ",":  # more members after the arguments: skip them
            self.pos, self.state, self.brackets = i + 1, "extra", _Brackets(depth=1)
        else:  # the closing brace is missing; carry on without it
            self.pos, self.state = i, "after"
        return True

    def _extra(self) -> bool:
        end = self.brackets.scan(self.text, self.pos)
        if end is None:
            self.pos = len(self.text)
            return False
        self.pos, self.state = end, "after"
        return True

    def _after(self) -> bool:  # after a call: another one, or the end of the block
        text, fmt = self.text, self.fmt
        i = _skip_ws(text, self.pos)
        if i == len(text):
            if self.final:
                return False
            raise _NeedMore
        if fmt.separator and _starts(text, i, fmt.separator, self.final):
            self.pos, self.state = i + len(fmt.separator), "element"
            return True
        if fmt.separator_optional and text[i] == "{":
            self.pos, self.state = i, "element"
            return True
        c = _Cursor(text, i, self.final)
        for token in fmt.block_close:  # as much of the closing as is there belongs to the block
            if not c.lit(token):
                break
        self.pos, self.state = c.i, self.after_block
        return True

    def _response(self) -> bool:  # generic's {"response": "..."}: the decoded string is the content
        text, i, n = self.text, self.pos, len(self.text)
        out: list[str] = []
        while i < n:
            j = _STRING_BODY.match(text, i).end()
            out.append(text[i:j])
            i = j
            if i >= n:
                break
            if text[i] == '"':
                self.content.text("".join(out))
                self.content.end_response()
                self.pos, self.state = i + 1, "response_end"
                return True
            escape = _unescape(text, i)
            if escape is None:  # incomplete: held back (and dropped if the output ends here)
                break
            out.append(escape[0])
            i += escape[1]
        self.content.text("".join(out))
        self.pos = i
        return False

    def _response_value_start(self) -> bool:  # generic's {"response": JSON}: the value's first character
        i = _skip_ws(self.text, self.pos)
        if i == len(self.text):
            raise _NeedMore
        self.pos, self.state, self.brackets = i, "response_value", _Brackets(depth=1)
        return True

    def _response_value(self) -> bool:  # the JSON value is the content, as it comes, up to the envelope's `}`
        end = self.brackets.scan(self.text, self.pos)
        stop = len(self.text) if end is None else end - 1
        if stop > self.pos:
            self.content.text(self.text[self.pos : stop])
        if end is None:
            self.pos = stop
            return False
        self.content.end_value()
        self.pos, self.state = end, "plain"
        return True

    def _response_end(self) -> bool:
        i = _skip_ws(self.text, self.pos)
        if i == len(self.text):
            if self.final:
                return False
            raise _NeedMore
        self.pos, self.state = i + (self.text[i] == "}"), "plain"
        return True


# The states inside a block of calls: an output that ends in one of them was cut there.
_CALL_STATES = frozenset(
    {
        "open",
        "element",
        "arguments",
        "element_end",
        "extra",
        "after",
        "response",
        "response_end",
        "response_value_start",
        "response_value",
    }
)


def _marker_prefix_len(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text[pos:] that could be the start of a marker."""
    for k in range(min(max(map(len, markers), default=1) - 1, len(text) - pos), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


# ---- the formats --------------------------------------------------------------------------------------
def _function_specs(tools: list[dict]) -> list[tuple[str, dict, str | None]]:
    """(name, parameters schema, description) for each OpenAI tool dict."""
    specs = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name or tool.get("type", "function") != "function":
            raise ValueError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
        schema = function.get("parameters")
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object, got {schema!r}")
        if "type" not in schema:  # arguments are always an object, even when the schema does not say so
            schema = {"type": "object", **schema}
        description = function.get("description")
        specs.append((name, schema, description if isinstance(description, str) else None))
    return specs


def _named_tool(tool_choice: str | dict, names: list[str]) -> str | None:
    """The tool that tool_choice names; None for "auto" and "required"."""
    if tool_choice in ("auto", "required"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            "tool_choice must be 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    if name not in names:
        raise ValueError(f"tool_choice names the tool {name!r}, which is not among the tools")
    return name


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def _arguments_text(arguments: str) -> str:
    """A call's arguments, fit to be written back into a JSON envelope."""
    if not arguments.strip():
        return "{}"
    try:
        json.loads(arguments)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)  # keep what was said, as a JSON string
    return arguments.strip()


class ToolCallFormat:
    name: str = ""
    uses_template_tools: bool = True  # False: tools go into generic_system_prompt, not the template
    # -- how calls are read (by _CallScanner) --
    markers: tuple[str, ...] = ()  # open a block of calls anywhere in the text
    start_markers: tuple[str, ...] = ()  # open one only at the start of the output ("": no marker at all)
    block_open: tuple[str, ...] = ()  # JSON tokens between the marker and the first call
    separator: str | None = None  # between the calls of one block
    separator_optional: bool = False  # calls may also follow each other with only whitespace between
    block_close: tuple[str, ...] = ()
    arguments_keys: tuple[str, ...] = ('"arguments"', '"parameters"')
    response_open: tuple[str, ...] = ()  # generic: `{"response": "` opens content as a JSON string
    json_response_open: tuple[str, ...] = ()  # generic with a response schema: `{"response": ` opens JSON
    response_schema: dict | None = None  # response_format's: an answer that is not a call is this JSON
    # -- how calls are written (structural tags and history) --
    call_prefix: str = ""  # before each `{"name": ..., "arguments": ...}`
    call_suffix: str = ""
    arguments_key: str = "arguments"
    call_separator: str = ""
    list_open: str = ""  # around all the calls
    list_close: str = ""

    def parse(self, text: str) -> ParsedOutput:
        scanner = _CallScanner(self)
        events = scanner.advance(text, final=True)
        content = "".join(e[1] for e in events if e[0] == "content")
        return ParsedOutput(content or None, [ToolCall(name, "".join(parts)) for name, parts in scanner.calls])

    def with_response_schema(self, schema: dict) -> ToolCallFormat:
        """This format for a request with response_format: an answer that is not a call is the
        schema's JSON (generic wraps it as {"response": JSON}; the other formats write it bare)."""
        fmt = copy.copy(self)
        fmt.response_schema = schema
        return fmt

    @property
    def json_response(self) -> bool:
        return self.response_schema is not None

    def structural_tag(
        self, tools: list[dict], tool_choice: str | dict, parallel: bool, response_schema: dict | None = None
    ) -> dict | None:
        """The grammar of the output. A named choice is exactly one call of that tool (as vLLM and
        OpenAI answer it, whatever parallel_tool_calls says); `required` is one call, or with parallel
        calls one or more, the output free to end after any complete call. `response_schema` (from
        response_format) applies to `auto` only: the output is then calls or the schema's JSON; a
        choice that demands a call leaves no answer for the schema to shape."""
        specs = _function_specs(tools)
        named = _named_tool(tool_choice, [name for name, _, _ in specs])
        if named is not None:
            specs = [s for s in specs if s[0] == named][:1]
            parallel = False
        tags = [self._call_tag(name, schema) for name, schema, _ in specs]
        if tool_choice == "auto":
            if not tags:
                fmt = None
            elif response_schema is not None:
                fmt = self._schema_format(tags, parallel, response_schema)
            else:
                fmt = self._auto_format(tags, parallel)
        elif not tags:
            raise ValueError("tool_choice 'required' needs at least one tool")
        else:
            fmt = self._calls_format(tags, parallel)
        return None if fmt is None else {"type": "structural_tag", "format": fmt}

    def history_text(self, tool_calls: list[ToolCall]) -> str:
        calls = [self._call_text(c.name, _arguments_text(c.arguments)) for c in tool_calls]
        return self.list_open + self.call_separator.join(calls) + self.list_close

    # ---- building blocks ------------------------------------------------------------------------------
    def _call_head(self, name: str) -> str:
        return f'{self.call_prefix}{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": '

    def _call_text(self, name: str, arguments: str) -> str:
        return self._call_head(name) + arguments + "}" + self.call_suffix

    def _call_tag(self, name: str, schema: dict) -> dict:
        # The begin string fixes the name, so only the arguments are left to the JSON schema.
        return {
            "type": "tag",
            "begin": self._call_head(name),
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}" + self.call_suffix,
        }

    def _calls_list(self, tags: list[dict], parallel: bool) -> dict:
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.call_separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }

    def _calls_format(self, tags: list[dict], parallel: bool) -> dict:
        """Nothing but one or more calls."""
        calls = self._calls_list(tags, parallel)
        if not (self.list_open or self.list_close):
            return calls
        return {"type": "sequence", "elements": [_const(self.list_open), calls, _const(self.list_close)]}

    def _auto_format(self, tags: list[dict], parallel: bool) -> dict | None:
        """Free text, or calls; None when that cannot be said cleanly."""
        return None

    def _schema_format(self, tags: list[dict], parallel: bool, schema: dict) -> dict:
        """Calls, or the response schema's JSON (bare: the formats that read calls from markers or
        from the call's own opening tell the two apart)."""
        return {"type": "or", "elements": [self._calls_format(tags, parallel), _json_schema(schema)]}


class HermesFormat(ToolCallFormat):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call."""

    name = "hermes"
    markers = ("<tool_call>",)
    block_close = ("</tool_call>",)
    call_prefix, call_suffix, call_separator = "<tool_call>\n", "\n</tool_call>", "\n"

    def _auto_format(self, tags: list[dict], parallel: bool) -> dict | None:
        return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "stop_after_first": not parallel}


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}; {...}` (maybe after
    <|python_tag|>), or it is plain content."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>", "")
    separator, separator_optional = ";", True
    arguments_keys = ('"parameters"', '"arguments"')
    arguments_key, call_separator = "parameters", "; "

    def _auto_format(self, tags: list[dict], parallel: bool) -> dict | None:
        # The parser reads any output that starts with `{` as calls, so content may not start so (nor
        # with whitespace, which the parser would skip to find that `{`).
        content = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[^{\s]"}, {"type": "any_text"}]}
        return {"type": "or", "elements": [self._calls_format(tags, parallel), content]}


class MistralFormat(ToolCallFormat):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. [TOOL_CALLS] is a special token,
    so a bare list opening the output is read as calls too (text decoded without special tokens)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start_markers = ("",)
    block_open, separator, block_close = ("[",), ",", ("]",)
    call_separator, list_open, list_close = ", ", "[TOOL_CALLS][", "]"

    def _auto_format(self, tags: list[dict], parallel: bool) -> dict | None:
        calls = {
            "type": "tag",
            "begin": self.list_open,
            "content": self._calls_list(tags, parallel),
            "end": self.list_close,
        }
        return {
            "type": "triggered_tags",
            "triggers": ["[TOOL_CALLS]"],
            "tags": [calls],
            "stop_after_first": not parallel,
        }


class GenericFormat(ToolCallFormat):
    """kvflow's protocol for templates without tool support (tools are described in the system prompt):
    the output is one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or
    `{"response": "text"}`."""

    name = "generic"
    uses_template_tools = False
    start_markers = ("",)
    block_open, separator, block_close = ("{", '"tool_calls"', ":", "["), ",", ("]", "}")
    response_open = ("{", '"response"', ":", '"')
    json_response_open = ("{", '"response"', ":")
    call_separator, list_open, list_close = ", ", '{"tool_calls": [', "]}"

    def _auto_format(self, tags: list[dict], parallel: bool) -> dict | None:
        return self._schema_format(tags, parallel, {"type": "string"})

    def _schema_format(self, tags: list[dict], parallel: bool, schema: dict) -> dict:
        # The answer stays inside the protocol's one object, so a schema whose JSON could be read as
        # {"tool_calls": ...} is never mistaken for calls.
        response = {"type": "sequence", "elements": [_const('{"response": '), _json_schema(schema), _const("}")]}
        return {"type": "or", "elements": [self._calls_format(tags, parallel), response]}


FORMATS: dict[str, type[ToolCallFormat]] = {
    cls.name: cls for cls in (HermesFormat, Llama3JsonFormat, MistralFormat, GenericFormat)
}


def get_tool_format(name: str, chat_template: str | None) -> ToolCallFormat:
    """The format called `name`; "auto" guesses it from the chat template's text."""
    if name == "auto":
        t = chat_template or ""
        if "<tool_call>" in t:
            name = "hermes"
        elif "[TOOL_CALLS]" in t:
            name = "mistral"
        elif "<|python_tag|>" in t or ("tools" in t and "parameters" in t):
            name = "llama3_json"
        else:  # no template, or one that cannot show tools (or shows them in a way kvflow cannot read)
            name = "generic"
    if name not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; valid: {', '.join(TOOL_CALL_PARSERS)}")
    return FORMATS[name]()


def generic_system_prompt(
    tools: list[dict], tool_choice: str | dict, parallel: bool, response_schema: dict | None = None
) -> str:
    """The instructions that stand in for a chat template's tool support (with GenericFormat)."""
    specs = _function_specs(tools)
    named = _named_tool(tool_choice, [name for name, _, _ in specs])
    described = [{"name": name, **({"description": d} if d else {}), "parameters": schema} for name, schema, d in specs]
    call = (
        '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments, as the tool\'s parameters schema says>}}]}'
    )
    lines = [
        "You can call these tools (functions), described here in JSON:",
        json.dumps(described, indent=2, ensure_ascii=False),
        "",
        "Reply with exactly one JSON object and nothing else.",
    ]
    if named is not None:
        lines.append(f"You must call the tool {json.dumps(named, ensure_ascii=False)}, like this:")
        lines.append(call.replace('"<tool name>"', json.dumps(named, ensure_ascii=False)))
    elif tool_choice == "required":
        lines += ["You must call one or more of the tools, like this:", call]
    elif response_schema is not None:
        lines += [
            "To call tools:",
            call,
            "To answer the user directly instead, give the answer as JSON following this schema:",
            json.dumps(response_schema, ensure_ascii=False),
            '{"response": <the answer>}',
        ]
    else:
        lines += ["To call tools:", call, "To answer the user directly instead:", '{"response": "<your answer>"}']
    if parallel and named is None:
        lines.append("The tool_calls list may hold several calls when the request needs more than one.")
    else:
        lines.append("Make at most one call: the tool_calls list holds exactly one entry.")
    lines.append("Tool results come back to you in later messages.")
    return "\n".join(lines)


# ---- streaming ----------------------------------------------------------------------------------------
class StreamingToolParser:
    """Reads the growing output text: its new events in order (`events`, for the Responses API's
    output items), or as an OpenAI chat.completion.chunk delta (`feed`)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._scanner = _CallScanner(fmt)
        self._done = False
        self.tool_call_ids: list[str] = []  # one per call announced so far, in order

    def events(self, text: str, finished: bool) -> list[tuple]:
        """`text`: the WHOLE output text so far (it only grows). What is new since the last call, in
        the output's order: ("content", text), ("call", index, name, call_id), ("args", index, fragment)."""
        if self._done:
            return []
        self._done = finished
        out = []
        for event in self._scanner.advance(text, finished):
            if event[0] == "call":
                self.tool_call_ids.append(make_tool_call_id())
                event = (*event, self.tool_call_ids[-1])
            out.append(event)
        return out

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, OpenAI delta.tool_calls entries) for what is new. One entry per call index,
        as OpenAI sends them: the first one of a call carries its id, type, name and the arguments
        written so far; clients (the openai SDK's stream helper) merge entries by index across chunks,
        and one chunk holding two entries of the same index makes them assemble a second call."""
        content: list[str] = []
        deltas: list[dict] = []
        for event in self.events(text, finished):
            if event[0] == "content":
                content.append(event[1])
            elif event[0] == "call":
                deltas.append(
                    {
                        "index": event[1],
                        "id": event[3],
                        "type": "function",
                        "function": {"name": event[2], "arguments": ""},
                    }
                )
            elif deltas and deltas[-1]["index"] == event[1]:  # a call's events are contiguous
                deltas[-1]["function"]["arguments"] += event[2]
            else:
                deltas.append({"index": event[1], "function": {"arguments": event[2]}})
        return "".join(content), deltas
