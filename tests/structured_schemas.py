"""JSON schemas for the structured-output test: a tiny random model decodes each one under
xgrammar, and every output must parse and validate.

The model is noise, so every schema must end by itself: free strings are ASCII `pattern`s of
bounded length (or enums/consts), arrays have maxItems, integers and numbers carry bounds.
Nothing is unbounded: sampled, an unbounded array or number ends soon enough, but greedy decoding
of the random model repeats itself (`[false, true, true, true, ...` or `6511546555555...`) until
max_tokens.

Keywords xgrammar 0.2.8 accepts without enforcing (uniqueItems, contains, if/then/else, not,
dependentRequired, allOf with several subschemas, oneOf exclusivity, $ref siblings, format
details, ...) are refused by kvflow, so they are absent here. Length-bounded strings
(`string_lengths`, `array_of_tags`, `empty_string_field`) check kvflow's fix of xgrammar's string
class, which lets raw control characters (invalid JSON) and UTF-8-encoded surrogates (which decode
to several U+FFFD and so break maxLength) through.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
_WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}
_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object with these properties, all required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 99}
    for i in range(depth):
        schema = _obj({f"level{depth - i}": schema})
    return schema


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    # --- flat objects, required vs optional ---
    (
        "flat_person",
        _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "active": {"type": "boolean"}}),
    ),
    (
        "flat_all_scalar_types",
        _obj(
            {
                "label": _WORD,
                "count": {"type": "integer", "minimum": -50, "maximum": 50},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
                "ok": {"type": "boolean"},
                "nothing": {"type": "null"},
            }
        ),
    ),
    (
        "optional_properties",
        _obj(
            {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "nick": _WORD, "vip": {"type": "boolean"}},
            required=["id"],
        ),
    ),
    ("all_optional_properties", _obj({"a": _DIGIT, "b": {"type": "boolean"}, "c": {"type": "null"}}, required=[])),
    ("required_out_of_order", _obj({"first": _DIGIT, "second": _DIGIT, "third": _DIGIT}, required=["third", "first"])),
    ("empty_object", {"type": "object", "properties": {}, "additionalProperties": False}),
    (
        "escaped_property_names",
        _obj(
            {
                "with space": _DIGIT,
                'quo"te': {"type": "boolean"},
                "back\\slash": {"type": "null"},
                "ключ": {"enum": ["да", "нет"]},
            }
        ),
    ),
    # --- nested objects ---
    (
        "nested_object",
        _obj(
            {
                "user": _obj(
                    {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "profile": _obj(
                            {
                                "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            }
                        ),
                    }
                )
            }
        ),
    ),
    ("nested_depth_5", _nested(5)),
    (
        "nested_optional_object",
        _obj({"meta": _obj({"tag": _WORD, "rank": _DIGIT}, required=[]), "id": _DIGIT}, required=["id"]),
    ),
    # --- arrays ---
    (
        "array_of_ints",
        _obj({"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5}}),
    ),
    (
        "nested_arrays",
        _obj(
            {
                "grid": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                }
            }
        ),
    ),
    (
        "matrix_2x2",
        _obj(
            {
                "m": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "number", "minimum": -1, "maximum": 1},
                    },
                }
            }
        ),
    ),
    (
        "array_of_objects",
        _obj(
            {
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                }
            }
        ),
    ),
    (
        "array_min_max_items",
        _obj({"picks": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}}),
    ),
    (
        "array_exact_length",
        _obj(
            {
                "rgb": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 255},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),
    ("array_empty_only", _obj({"none": {"type": "array", "maxItems": 0}})),
    (
        "tuple_prefix_items",
        _obj(
            {
                "pair": {
                    "type": "array",
                    "prefixItems": [{"enum": ["x", "y"]}, _DIGIT, {"type": "boolean"}],
                    "items": False,
                }
            }
        ),
    ),
    (
        "array_of_tags",
        _obj({"tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 2, "maxLength": 6}}}),
    ),
    # --- enums and const ---
    (
        "enum_strings",
        _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
    ),
    ("enum_numbers", _obj({"level": {"enum": [1, 2, 3, 5, 8]}, "ratio": {"enum": [0.25, 0.5, 1.5, -2.75]}})),
    ("enum_mixed", _obj({"setting": {"enum": ["auto", 0, 1.5, True, None, [1, 2], {"k": "v"}]}})),
    (
        "enum_escapes_unicode",
        _obj({"s": {"enum": ['say "hi"', "back\\slash", "tab\there", "line\nbreak", "東京", "🚀 go"]}}),
    ),
    ("const_values", _obj({"version": {"const": 2}, "kind": {"const": "event"}, "flags": {"const": [1, "two", None]}})),
    ("const_object", {"const": {"status": "ok", "codes": [200, 201], "nested": {"deep": True}}}),
    # --- numbers ---
    (
        "integer_bounds",
        _obj(
            {
                "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            }
        ),
    ),
    (
        "integer_exclusive_bounds",
        _obj(
            {
                "pct": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
                "neg": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": -1},
            }
        ),
    ),
    (
        "number_bounds",
        _obj(
            {
                "prob": {"type": "number", "minimum": 0, "maximum": 1},
                "kelvin": {"type": "number", "minimum": -273.15, "maximum": -200},
            }
        ),
    ),
    (
        "number_exclusive_bounds",
        _obj(
            {
                "x": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
                "y": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.5},
            }
        ),
    ),
    ("integer_multiple_of", _obj({"step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}})),
    # --- booleans and null ---
    (
        "null_and_type_list",
        _obj(
            {
                "deleted_at": {"type": "null"},
                "parent": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
                "flag": {"type": ["boolean", "null"]},
            }
        ),
    ),
    # --- anyOf ---
    ("anyof_scalars", _obj({"v": {"anyOf": [_DIGIT, {"type": "boolean"}, {"type": "null"}]}})),
    ("anyof_string_or_null", _obj({"nickname": {"anyOf": [_WORD, {"type": "null"}]}})),
    (
        "anyof_objects",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 10}}),
                        _obj({"kind": {"const": "rect"}, "w": _DIGIT, "h": _DIGIT}),
                    ]
                }
            }
        ),
    ),
    # --- string patterns ---
    (
        "pattern_codes",
        _obj(
            {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            }
        ),
    ),
    (
        "pattern_alternation",
        _obj(
            {
                "method": {"type": "string", "pattern": "^(GET|POST|PUT|DELETE)$"},
                "path": {"type": "string", "pattern": "^/[a-z]{1,6}(/[a-z0-9]{1,6}){0,2}$"},
            }
        ),
    ),
    (
        "pattern_date_like",
        _obj(
            {
                "day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
            }
        ),
    ),
    ("string_lengths", _obj({"user": {"type": "string", "minLength": 3, "maxLength": 10}})),
    ("empty_string_field", _obj({"blank": {"type": "string", "maxLength": 0}, "n": _DIGIT})),
    # --- $defs and $ref ---
    (
        "defs_ref",
        {
            "$defs": {"point": _obj({"x": _DIGIT, "y": _DIGIT})},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
    ),
    (
        "defs_ref_chain",
        {
            "$defs": {
                "city": {"enum": ["Oslo", "Rome"]},
                "address": _obj({"street": _NAME, "city": {"$ref": "#/$defs/city"}}),
            },
            **_obj(
                {"home": {"$ref": "#/$defs/address"}, "alt": {"anyOf": [{"$ref": "#/$defs/city"}, {"type": "null"}]}}
            ),
        },
    ),
    (
        "recursive_list",
        {
            "$defs": {
                "node": _obj(
                    {"v": _DIGIT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, required=["v"]
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    # --- additionalProperties, patternProperties, propertyNames, min/maxProperties ---
    (
        "additional_properties_schema",
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]{1,4}$"},
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxProperties": 3,
        },
    ),
    (
        "pattern_properties",
        {
            "type": "object",
            "patternProperties": {"^x_[a-z]{1,3}$": {"type": "boolean"}},
            "additionalProperties": False,
            "maxProperties": 2,
        },
    ),
    (
        "min_max_properties",
        _obj({"a": _DIGIT, "b": _DIGIT, "c": _DIGIT}, required=[], minProperties=1, maxProperties=2),
    ),
    # --- top-level non-objects ---
    ("top_array_of_enums", {"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 1, "maxItems": 4}),
    ("top_string_pattern", {"type": "string", "pattern": "^[a-z]{3,6}[0-9]{0,2}$"}),
    ("top_enum", {"enum": ["yes", "no", "maybe", 42, None]}),
    ("top_bool_array", {"type": "array", "items": {"type": "boolean"}, "maxItems": 6}),
    ("top_number", {"type": "number", "minimum": -1000, "maximum": 1000}),
]

assert len(SCHEMAS) == 50 and len({name for name, _ in SCHEMAS}) == 50
