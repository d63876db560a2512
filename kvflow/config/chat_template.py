"""The `chat_template` option (vLLM's --chat-template): a file's path or the template itself.
Read here when the config is validated; compiled by the engine (kvflow.models.chat_template)."""

from __future__ import annotations

import os


def chat_template_text(value: str, option: str = "chat_template") -> str:
    """The template `value` names: a file's contents, or `value` itself when it reads as a Jinja
    template; a ValueError naming `option` when it is neither."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{option} {value[:200]!r} is neither a file nor a Jinja template")
