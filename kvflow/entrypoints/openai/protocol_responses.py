"""Request bodies of the Responses API (`POST /v1/responses`), and their translation into a chat
request, so that a response is rendered, constrained and parsed exactly as a chat completion is.

As in protocol.py: types are strict (JSON Schema's rules, so the OpenAPI document says exactly what is
accepted), unknown fields are ignored as OpenAI and vLLM do, and fields OpenAI knows that kvflow cannot
honour are refused with 400 naming them (`refused()`), never silently dropped. Input items and tools
get a first look before pydantic's (`check_input`, `check_tools`) so that an unsupported kind is a 400
naming the exact field rather than a union error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvflow.entrypoints.openai.protocol import MAX_MESSAGES, MAX_TOOLS
from kvflow.entrypoints.openai.utils import APIError

_CONFIG = ConfigDict(extra="ignore", strict=True)
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output")


# ---- input items ----------------------------------------------------------------------------------
class TextPart(BaseModel):
    """A text content part: `input_text` (what the user or system said), `output_text` (an earlier
    answer sent back)."""

    model_config = _CONFIG
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = _CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output item, sent back as input)."""

    model_config = _CONFIG
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to continue from."""

    model_config = _CONFIG
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


def check_input(v: Any) -> Any:
    """Clear errors, naming the field, for input kvflow does not take: an item type other than message,
    function_call and function_call_output, a content part other than text."""
    if not isinstance(v, list):
        return v
    if len(v) > MAX_MESSAGES:
        raise APIError(
            400, f"input holds {len(v)} items; at most {MAX_MESSAGES} are allowed", param="input", code="invalid_value"
        )
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise APIError(
                400,
                f"input[{i}].type {str(kind)[:40]!r} is not supported; kvflow takes {', '.join(_ITEM_TYPES)} items",
                param=f"input.{i}.type",
                code="invalid_value",
            )
        field = "output" if kind == "function_call_output" else "content"
        parts = item.get(field)
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            ptype = part.get("type") if isinstance(part, dict) else None
            if isinstance(ptype, str) and ptype not in _TEXT_PARTS:
                raise APIError(
                    400,
                    f"input[{i}].{field}[{j}].type {ptype[:40]!r} is not supported; only text parts "
                    f"({', '.join(_TEXT_PARTS)}) are",
                    param=f"input.{i}.{field}.{j}.type",
                    code="invalid_value",
                )
    return v


# ---- tools and the text format ---------------------------------------------------------------------
class FunctionTool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def check_tools(v: Any) -> Any:
    if not isinstance(v, list):
        return v
    for i, tool in enumerate(v):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(
                400,
                f"tools[{i}].type {kind[:40]!r} is not supported; kvflow runs no built-in tools, only function tools",
                param=f"tools.{i}.type",
                code="invalid_value",
            )
    return v


class NamedFunction(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON following a schema."""

    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's response_format for this format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = _CONFIG
    format: TextFormat | None = None
    verbosity: str | None = None  # ignored: the model decides how much it says


# ---- the request -------------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    model_config = _CONFIG

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None  # default: up to the context
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=MAX_METADATA)
    user: str | None = None
    # accepted and ignored (docs/api/responses.md lists why)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused unless off (refused())
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # extras, as on the other endpoints (vLLM's)
    seed: int | None = None
    top_k: int | None = None
    priority: int = 0

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, v: Any) -> Any:
        return check_input(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, v: Any) -> Any:
        return check_tools(v)

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key in v or ():
            if len(key) > 64:
                raise ValueError(f"metadata keys are at most 64 characters, got one of {len(key)}")
        return v

    def refused(self) -> None:
        """Fields OpenAI knows that kvflow cannot honour: a 400 naming each, never a silent drop."""
        refusals = [
            ("truncation", self.truncation == "auto", "truncation 'auto' is not supported: kvflow never drops input"),
            ("background", bool(self.background), "background responses are not supported"),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs is not supported here; use /v1/chat/completions"),
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls is not supported"),
            (
                "conversation",
                self.conversation is not None,
                "conversations are not supported; use previous_response_id",
            ),
            ("prompt", self.prompt is not None, "stored prompts are not supported; send instructions and input"),
        ]
        for name, refused, message in refusals:
            if refused:
                raise APIError(400, message, param=name, code="unsupported_parameter")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in {
            t.name for t in self.tools or ()
        }:
            raise APIError(
                400,
                f"tool_choice names the function {self.tool_choice.name[:64]!r}, which is not among the tools",
                param="tool_choice",
                code="invalid_value",
            )

    # ---- what the response echoes --------------------------------------------------------------------
    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def text_echo(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.echo() if fmt is not None else {"type": "text"}}

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message), the shape they are stored in."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True) for item in self.input]

    # ---- the chat request ---------------------------------------------------------------------------
    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The /v1/chat/completions body for this request after `history` (the items of the
        conversation so far: earlier inputs and outputs). Instructions are this request's only: as
        in OpenAI's API, those of a previous response are not carried over."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += items_to_messages(history + self.input_items())
        fmt = self.text.format if self.text is not None else None
        body: dict[str, Any] = {
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": fmt.response_format() if fmt is not None else None,
            "seed": self.seed,
            "top_k": self.top_k,
            "priority": self.priority,
            "user": self.user,
        }
        if self.tools:
            body["tools"] = [t.chat_tool() for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = (
                self.tool_choice
                if isinstance(self.tool_choice, str)
                else {"type": "function", "function": {"name": self.tool_choice.name}}
            )
        return {k: v for k, v in body.items() if v is not None}


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items -> chat messages: a function_call joins the assistant message before it (its
    text and its calls are one turn, as the chat templates expect), a function_call_output becomes a
    tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p["text"] for p in content)
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p["text"] for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages
