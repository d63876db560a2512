"""One `StructuredOutputsParams` -> one xgrammar `CompiledGrammar`, or a `GrammarError` saying
what is wrong with it in words a client can act on.

JSON schemas are checked twice before xgrammar sees them: against the JSON Schema meta-schema
(a malformed schema is the client's error), and for keywords xgrammar would accept but not
enforce (an output that ignores part of the schema would be a silently wrong 200).
"""

from __future__ import annotations

import re
from typing import Any

from kvflow.structured_output.params import StructuredOutputsParams

# Whitespace xgrammar may put between two JSON tokens when whitespace is free: bounded, so a model
# cannot spend its budget on blank lines (llama.cpp's JSON grammars bound it similarly); a newline
# and four levels of four-space indentation still fit.
MAX_WHITESPACE = 20
# Keywords xgrammar 0.2.8 accepts without enforcing them: a schema using one is refused rather than
# answered with output that may not validate (tests/structured_output/test_structured_output.py shows each refusal).
UNENFORCED_KEYWORDS = frozenset(
    {
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "if",
        "then",
        "else",
        "not",
    }
)
# Keywords that only describe (fine next to a $ref, whose other siblings xgrammar ignores).
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$id",
        "$schema",
        "$anchor",
        "$defs",
        "definitions",
    }
)
_LOOKAROUND = re.compile(r"\(\?(=|!|<=|<!)")


class GrammarError(ValueError):
    """The constraint cannot be enforced: a 400 for the client, never an unconstrained output."""


def compile_grammar(compiler: Any, spec: StructuredOutputsParams) -> Any:
    if spec.reasoning_prefix is not None:
        return _compile_after_reasoning(compiler, spec)
    kind = spec.kind
    try:
        if kind == "json":
            check_schema(spec.json)  # type: ignore[arg-type]
            return compiler.compile_grammar(_json_grammar(spec.text, not spec.disable_any_whitespace, strict=True))
        if kind == "json_object":
            return compiler.compile_grammar(
                _json_grammar('{"type": "object"}', not spec.disable_any_whitespace, strict=False)
            )
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(ebnf_literal(c) for c in spec.choice or []))
        if kind == "grammar":
            return compiler.compile_grammar(spec.grammar)
        return compiler.compile_grammar(_structural_tag_grammar(spec.structural_tag))  # type: ignore[arg-type]
    except GrammarError:
        raise
    except Exception as e:  # xgrammar's parse and conversion errors (RuntimeError), or anything it raises
        raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {_xgrammar_message(e)}") from None


def _compile_after_reasoning(compiler: Any, spec: StructuredOutputsParams) -> Any:
    """The reasoning prefix (free text in think tags, kvflow/entrypoints/openai/reasoning_parsers.py)
    followed by the constraint: one grammar, xgrammar's concatenation of the two."""
    import dataclasses

    import xgrammar as xgr

    kind = spec.kind
    inner = dataclasses.replace(spec, reasoning_prefix=None)
    try:
        if kind == "regex":
            constrained = xgr.Grammar.from_regex(spec.regex)
        else:
            constrained = _grammar_of(inner)
        prefix = xgr.Grammar.from_ebnf(spec.reasoning_prefix)
        return compiler.compile_grammar(xgr.Grammar.concat(prefix, constrained))
    except GrammarError:
        raise
    except Exception as e:
        raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {_xgrammar_message(e)}") from None


def _grammar_of(spec: StructuredOutputsParams) -> Any:
    """The constraint (any kind but regex) as an xgrammar Grammar, checked as compile_grammar checks it."""
    import xgrammar as xgr

    kind = spec.kind
    if kind == "json":
        check_schema(spec.json)  # type: ignore[arg-type]
        return xgr.Grammar.from_ebnf(_json_grammar(spec.text, not spec.disable_any_whitespace, strict=True))
    if kind == "json_object":
        return xgr.Grammar.from_ebnf(_json_grammar('{"type": "object"}', not spec.disable_any_whitespace, strict=False))
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in spec.choice or []))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.grammar)  # type: ignore[arg-type]
    return xgr.Grammar.from_ebnf(_structural_tag_grammar(spec.structural_tag))  # type: ignore[arg-type]


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string as [^"\\\r\n]: raw
# control characters (invalid in JSON) pass, so strict parsers reject the output (xgrammar issue
# #800). Both its string classes also let UTF-8-encoded surrogates through, which decode to
# several U+FFFD and so break maxLength. Both become the class JSON means.
_LAX_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def _strict_strings(ebnf: str) -> str:
    for lax in _LAX_STRING_CHARS:
        ebnf = ebnf.replace(lax, _JSON_STRING_CHAR)
    return ebnf


def _json_grammar(schema: str, any_whitespace: bool, strict: bool) -> str:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, strict_mode=strict, max_whitespace_cnt=MAX_WHITESPACE
    )
    return _strict_strings(str(grammar))


def _structural_tag_grammar(text: str) -> str:
    """A structural tag (JSON text) as EBNF, with its JSON contents held to the same rules as
    json schemas: checked schemas, bounded whitespace, control characters escaped."""
    import json

    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
                check_schema(node["json_schema"])
                node.setdefault("max_whitespace_cnt", MAX_WHITESPACE)
            stack.extend(v for k, v in node.items() if k != "json_schema")
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag, ensure_ascii=False))
    return _strict_strings(str(grammar))


def check_schema(schema: dict[str, Any]) -> None:
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise GrammarError(f"the JSON schema is invalid{' at ' + where if where else ''}: {e.message[:300]}") from None
    for path, node in _schema_nodes(schema, "#"):
        problem = _unenforceable(node)
        if problem is not None:
            raise GrammarError(
                f"the JSON schema at {path} {problem}, which kvflow cannot enforce during decoding; "
                "change it (or check that part after generation)"
            )


def _unenforceable(node: dict[str, Any]) -> str | None:
    """Why xgrammar would not enforce this schema node as written, or None."""
    used = sorted(k for k in node if k in UNENFORCED_KEYWORDS)
    if used:
        return f"uses {', '.join(used)}"
    if node.get("uniqueItems") is True:
        return "uses uniqueItems"
    if "oneOf" in node and "discriminator" not in node:
        return "uses oneOf without a discriminator (only anyOf semantics can be enforced: use anyOf)"
    if len(node.get("allOf", ())) > 1:
        return "uses allOf with several schemas (merge them into one)"
    if "multipleOf" in node and node.get("type") != "integer":
        return "uses multipleOf on a non-integer"
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    for other in ("pattern", "format"):
        if lengths and other in node:
            return f"uses {other} with {' and '.join(lengths)} (write the length into a pattern instead)"
    if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
        return "uses a lookaround in its pattern"
    missing = [r for r in node.get("required", ()) if r not in node.get("properties", {})]
    if missing and node.get("additionalProperties") is not True:
        return f"requires {missing[0]!r}, which is not among its properties"
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            return f"uses the remote $ref {ref[:80]!r} (only local references such as #/$defs/... work)"
        siblings = sorted(k for k in node if k != "$ref" and k not in _ANNOTATIONS)
        if siblings:
            return f"uses {', '.join(siblings)} next to $ref (xgrammar would ignore them: wrap both in allOf of one)"
    return None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def _schema_nodes(node: Any, path: str):
    """Every (JSON pointer, subschema) of a schema, the schema itself first."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            yield from _schema_nodes(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or ()) if isinstance(node.get(key), list) else ():
            yield from _schema_nodes(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_ONE:
        yield from _schema_nodes(node.get(key), f"{path}/{key}")


def ebnf_literal(s: str) -> str:
    """A string as an EBNF literal: quotes and backslashes escaped, control characters as
    fixed-width \\uXXXX (xgrammar reads \\x escapes greedily)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _xgrammar_message(e: BaseException) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    return _LOCATION.sub("", str(e).strip())[:500]
