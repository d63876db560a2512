"""Chat templates rendered as transformers renders them, without importing transformers.

A port of `transformers.utils.chat_template_utils` (v5) for one conversation with JSON-schema
tools: the same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loopcontrols, the
`{% generation %}` tag, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, the
restricted `dict` and `namespace`), the same message normalization (objects to dicts, None-valued
keys dropped, reasoning aliases) and the same template variables. `renders_here` says which calls
this covers; `FastTokenizer` sends the others to transformers. tests/models/test_gguf.py compares the two.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvflow.config.chat_template import chat_template_text

# apply_chat_template's own parameters that change what it does beyond rendering one conversation.
_HF_ONLY = frozenset(
    {
        "documents",
        "chat_template",
        "continue_final_message",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What a caller's extra template variables may not be: apply_chat_template's parameters and the
# variables it sets itself from them.
_NOT_VARIABLES = _HF_ONLY | {"conversation", "messages", "tools", "add_generation_prompt", "tokenize"}
MAX_TEMPLATE_KWARGS = 64


def read_chat_template(value: str, option: str = "chat_template") -> str:
    """vLLM's --chat-template: a file's path or the template itself (`chat_template_text`), as its
    text; a ValueError naming `option` when it is neither, or does not compile (with jinja's line
    and message)."""
    import jinja2

    text = chat_template_text(value, option)
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{option}: the template does not compile (line {e.lineno}: {e.message})") from None
    return text


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's extra template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`), checked: a name that is one of apply_chat_template's own parameters would
    change what it does rather than what the template sees, and is refused."""
    if not kwargs:
        return {}
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs holds {len(kwargs)} keys; at most {MAX_TEMPLATE_KWARGS} are allowed")
    taken = sorted(k for k in kwargs if k in _NOT_VARIABLES)
    if taken:
        raise ValueError(
            f"chat_template_kwargs cannot set {', '.join(repr(k[:64]) for k in taken)}: request fields or "
            "apply_chat_template's own parameters, not template variables"
        )
    return dict(kwargs)


def check_continuation(add_generation_prompt: bool, continue_final_message: bool, last_role: str | None) -> None:
    """continue_final_message (the prompt ends inside the last message, which the output goes on
    with) needs that message to be the assistant's, and no new assistant turn opened after it."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the last message"
        )
    if last_role != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's")


def renders_here(conversation: Any, tools: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether `render` gives transformers' result for this call (else: ask transformers)."""
    return (
        isinstance(conversation, list)
        and bool(conversation)
        and isinstance(conversation[0], dict)
        and (tools is None or all(isinstance(t, dict) for t in tools))
        and not (_HF_ONLY & kwargs.keys())
    )


def render(
    template: str,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """`template` over one conversation; `variables`: the special tokens, then the caller's extras."""
    messages = []
    for m in map(_to_dicts, conversation):
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        messages.append({k: v for k, v in m.items() if v is not None})  # a None content renders as missing
    chat = _plain(messages)
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return _compile(template).render(
        messages=_alias_reasoning(chat),
        tools=_plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(dict(variables)),
    )


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """What the sandbox may see: plain JSON types rebuilt, anything else an inert placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # numpy scalars (np.bool_ is not an int)
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant
        # masks; rendering alone just emits the body.
        tags = {"generation"}  # noqa: RUF012 (jinja2 reads it as a class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
