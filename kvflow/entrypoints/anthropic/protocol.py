"""Request bodies of Anthropic's Messages API (pydantic, strict types as in the OpenAI entrypoint).

Unknown fields are ignored, as Anthropic's API does; fields Anthropic knows that kvflow cannot honour
are refused with a 400 naming them (`refused_fields`), never silently dropped. Responses are plain
dicts built by serving.py (their shapes follow Anthropic's API reference).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvflow.entrypoints.openai.protocol import MAX_MESSAGES, MAX_TOOLS
from kvflow.entrypoints.openai.utils import APIError

_CONFIG = ConfigDict(extra="ignore", strict=True)
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # Anthropic's rule for custom tool names (OpenAI's too)


# ---- content blocks ---------------------------------------------------------------------------------
class TextBlockParam(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ToolUseBlockParam(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else join_text(self.content)


class ThinkingBlockParam(BaseModel):
    """Earlier reasoning sent back by a client: accepted and left out of the prompt (Anthropic's API
    drops earlier turns' thinking from the context too)."""

    model_config = _CONFIG
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(BaseModel):
    model_config = _CONFIG
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]
# Which blocks each role may send (Anthropic's rules); images and documents need a vision model.
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def join_text(blocks: list[TextBlockParam]) -> str:
    # Blocks are separate pieces of text (a reminder, then the question): a newline keeps them apart.
    return "\n".join(b.text for b in blocks)


class MessageParam(BaseModel):
    model_config = _CONFIG
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


def check_messages(v: Any) -> Any:
    """Clear errors, naming the field, for what Anthropic refuses in messages and for the blocks kvflow
    cannot read (before pydantic's union errors would say it less plainly). Raises APIError, which
    pydantic lets through."""
    if not isinstance(v, list):
        return v
    if len(v) > MAX_MESSAGES:
        raise APIError(400, f"messages holds {len(v)} messages; at most {MAX_MESSAGES} are allowed", param="messages")
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise APIError(400, f"messages.{i}: must be an object with a role and content", param=f"messages.{i}")
        role = m.get("role")
        if not isinstance(role, str) or role not in _BLOCKS:
            hint = " (a system prompt goes in the top-level `system` field)" if role == "system" else ""
            raise APIError(
                400,
                f"messages.{i}.role: must be 'user' or 'assistant', got {str(role)[:40]!r}{hint}",
                param=f"messages.{i}.role",
            )
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCKS[role]:
                allowed = ", ".join(_BLOCKS[role])
                raise APIError(
                    400,
                    f"messages.{i}.content.{j}.type: {kind[:40]!r} blocks are not supported in a {role} message "
                    f"(this server reads {allowed})",
                    param=f"messages.{i}.content.{j}.type",
                )
    return v


# ---- tools ------------------------------------------------------------------------------------------
class ToolParam(BaseModel):
    model_config = _CONFIG
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]


def check_tools(v: Any) -> Any:
    """Anthropic's own tools (web search, bash, computer use...) run on Anthropic's side: refused,
    naming the tool, rather than reported as a missing input_schema."""
    if not isinstance(v, list):
        return v
    for i, t in enumerate(v):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise APIError(
                400,
                f"tools.{i}.type: {str(kind)[:60]!r} tools run on Anthropic's servers and are not supported; "
                "give custom tools (name, description, input_schema)",
                param=f"tools.{i}.type",
            )
    return v


class ToolChoiceAuto(BaseModel):
    model_config = _CONFIG
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(BaseModel):
    model_config = _CONFIG
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(BaseModel):
    model_config = _CONFIG
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(BaseModel):
    model_config = _CONFIG
    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class MetadataParam(BaseModel):
    model_config = _CONFIG
    user_id: str | None = None


# ---- requests ---------------------------------------------------------------------------------------
class ConversationFields(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: everything that makes the prompt."""

    model_config = _CONFIG

    model: str | None = None  # required by Anthropic; here the served model when left out, as on /v1/chat
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    # Refused unless off: there is no reasoning output on this endpoint.
    thinking: dict[str, Any] | None = None
    # Refused when given: they need Anthropic's own infrastructure.
    mcp_servers: list[Any] | None = None
    container: Any = None

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v: Any) -> Any:
        return check_messages(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, v: Any) -> Any:
        return check_tools(v)

    def refused_fields(self) -> None:
        """Raises a 400 naming the first field given that this server cannot honour."""
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise APIError(
                400, "thinking: extended thinking is not supported; leave it out or disable it", param="thinking"
            )
        for name in ("mcp_servers", "container"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: not supported by this server", param=name)

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return join_text(self.system) or None


class MessagesRequest(ConversationFields):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range; default 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    # Accepted and without effect on the output: metadata.user_id only keys fair sharing.
    metadata: MetadataParam | None = None
    # Refused when it asks for a format: structured output is the OpenAI endpoints' response_format.
    output_config: dict[str, Any] | None = None

    def refused_fields(self) -> None:
        super().refused_fields()
        if self.output_config is not None and self.output_config.get("format") is not None:
            raise APIError(
                400,
                "output_config.format: structured output is not supported on /v1/messages; "
                "use tools, or response_format on /v1/chat/completions",
                param="output_config.format",
            )


class CountTokensRequest(ConversationFields):
    pass
