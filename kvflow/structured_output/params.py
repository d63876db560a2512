"""What a request asks its output to follow: `StructuredOutputsParams`, named as in vLLM."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

# Limits a request can reach (docs/serving.md lists them with SamplingParams' own).
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex, grammar or structural tag, as text
MAX_CHOICES = 1024
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a JSON schema (dict or its JSON text); `regex` a
    regular expression the whole output matches; `choice` a list of strings the output is one of;
    `grammar` an EBNF grammar (GBNF style, as xgrammar reads it, with a `root` rule);
    `json_object` any JSON object; `structural_tag` an xgrammar structural tag (JSON text; the
    server builds these for tool calls). `disable_any_whitespace`: JSON without free whitespace
    between tokens (compact output; small models otherwise may emit whitespace for a long time).

    `reasoning_prefix`: set by the server only (never read from a request): an EBNF grammar (with a
    `root` rule) of the text before the constrained part, the think block of a reasoning model
    (kvflow/entrypoints/openai/reasoning_parsers.py); the constraint applies after it."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    reasoning_prefix: str | None = field(default=None, metadata={"wire": False})

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of "
                + ", ".join(_KINDS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(value).__name__}")
            self.json = value
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice holds {len(value)} strings; at most {MAX_CHOICES} are allowed"
                )
            if any(not isinstance(c, str) or not c for c in value):
                raise ValueError("structured_outputs.choice must hold non-empty strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true")
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        size = len(self.text)
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{kind} is {size} characters; at most {MAX_GRAMMAR_CHARS} are allowed")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as text: what is compiled, and (with the kind) the compile-cache key.
        Schemas keep their key order: properties are generated in the order they are written."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return _json.dumps(value, ensure_ascii=False)
        if self.kind == "choice":
            return _json.dumps(value, ensure_ascii=False)
        if self.kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str, bool, str | None]:
        return self.kind, self.text, self.disable_any_whitespace, self.reasoning_prefix
