"""Reasoning output (`--reasoning-parser`): the text a thinking model writes between think tags
goes to `reasoning_content` (vLLM's field), the rest to `content`.

- `qwen3`: an output that begins with `<think>` reasons until `</think>`; the text after it is
  content. An output that does not begin with `<think>` (thinking disabled: the template wrote an
  empty think block into the prompt) is all content.
- `deepseek_r1`: the template opens `<think>` in the prompt, so the output reasons from its start
  (a leading `<think>` the model writes itself is dropped) until `</think>`; after it, content. An
  output without `</think>` is all reasoning.

A think block that never closes (the output cut by max_tokens) stays reasoning, streamed or not:
streamed deltas cannot be taken back, and both answers are the same text split the same way.

`split()` reads a whole output; `StreamingReasoningParser` reads it in deltas and never sends part
of a tag as text: a suffix that could still grow into a tag is held back until it cannot, or until
the output ends. `grammar_prefix()` is the EBNF of the reasoning part, which a constraint (a JSON
schema, a tool-call grammar) follows: kvflow/structured_output applies the constraint after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config.server import REASONING_PARSERS

# Whitespace the grammar allows between `</think>` and the constrained part (Qwen3 writes "\n\n").
_MAX_GAP = 20


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # True: the output reasons from its start (the prompt opened the block); False: only after `start`.
    starts_in_reasoning: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when the output has no think block."""
        if text.startswith(self.start):
            text = text[len(self.start) :]
        elif not self.starts_in_reasoning:
            return None, text
        reasoning, end, content = text.partition(self.end)
        return reasoning, content if end else ""

    def streaming(self) -> StreamingReasoningParser:
        return StreamingReasoningParser(self)

    def grammar_prefix(self) -> str:
        """EBNF (with a `root` rule) of the reasoning part before a constrained answer: free text
        without the end tag, then the end tag and a little whitespace. qwen3 may skip the block."""
        start = _ebnf_literal(self.start)
        end = _ebnf_literal(self.end)
        gap = f"[ \\t\\r\\n]{{0,{_MAX_GAP}}}"
        body = f'reasoning_text ::= TagDispatch(loop_after_dispatch=false, excludes=("{_ebnf_inner(self.end)}"))'
        if self.starts_in_reasoning:
            return f"root ::= {start}? reasoning_text {end} {gap}\n{body}\n"
        return f"root ::= ({start} reasoning_text {end} {gap})?\n{body}\n"


class StreamingReasoningParser:
    """Feed the output's new text; get (reasoning delta, content delta). `finished=True` on the last
    feed flushes what was held back. The concatenated deltas equal `split()` of the whole text."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._held = ""
        self.saw_reasoning = False

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        fmt = self.fmt
        buf = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        if self._state == "start":
            if buf.startswith(fmt.start):
                buf = buf[len(fmt.start) :]
                self._state = "reasoning"
            elif fmt.start.startswith(buf) and not finished:
                self._held = buf  # may still become the start tag
                return "", ""
            else:
                self._state = "reasoning" if fmt.starts_in_reasoning else "content"
            self.saw_reasoning = self._state == "reasoning"
        if self._state == "reasoning":
            before, end, after = buf.partition(fmt.end)
            if end:
                reasoning.append(before)
                self._state = "content"
                buf = after
            else:
                keep = 0 if finished else _tag_prefix_len(buf, fmt.end)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                buf = ""
        if self._state == "content":
            content.append(buf)
        return "".join(reasoning), "".join(content)


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _ebnf_inner(s: str) -> str:
    return "".join("\\" + ch if ch in '"\\' else ch for ch in s)


def _ebnf_literal(s: str) -> str:
    return '"' + _ebnf_inner(s) + '"'


_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
}


def get_reasoning_format(name: str | None) -> ReasoningFormat | None:
    if name is None:
        return None
    if name not in _FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return _FORMATS[name]
