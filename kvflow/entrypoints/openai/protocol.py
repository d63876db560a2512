"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to `SamplingParams`.

Responses are plain dicts built by the serving modules (their shapes follow OpenAI's API reference).
Unknown fields are ignored, as OpenAI and vLLM do; fields OpenAI knows and kvflow does not implement
yet are refused with 400 naming them. Ranges are checked by `SamplingParams` so that the offline
API and the server report the same limits; pydantic checks types (strictly: JSON Schema's rules), the
per-role message rules and the limits that exist only on the wire (top_logprobs, n, list lengths).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from kvflow.entrypoints.openai.utils import APIError
from kvflow.sampling_params import MAX_N, SamplingParams

# Limits of the wire only (the README lists them with SamplingParams' own).
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_MESSAGES = 1024  # messages in one chat request
# Strict types: a JSON string is never taken for a number, nor true for 1 (JSON Schema's rules,
# so the OpenAPI schema says exactly what is accepted). Unknown fields are ignored, as OpenAI does.
_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _CONFIG

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None  # OpenAI default 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_PROMPTS},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
     "minItems": 1, "maxItems": MAX_PROMPTS},
]}


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]  # required; see parse_prompts
    max_tokens: int | None = 16  # OpenAI's default; null: up to the context
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[Prompt]:
        return parse_prompts(v)

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}); best_of > n is not supported, got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (the engine has no prompt logprobs)")
        return self._sampling(self.max_tokens, self.logprobs)


def parse_prompts(v: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> prompts."""
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if v is None:
        raise ValueError("prompt is required")
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise ValueError(shape)
    if not v:
        raise ValueError("prompt must not be empty")
    if all(_is_token(x) for x in v):
        return [list(v)]
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"prompt holds {len(v)} prompts; at most {MAX_PROMPTS} are allowed in one request")
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in v):
        if any(not x for x in v):
            raise ValueError("prompt must not contain an empty token list")
        return [list(x) for x in v]
    raise ValueError(shape)


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- chat messages: OpenAI's per-role rules ----------------------------------------------------------
class TextPart(BaseModel):
    model_config = _CONFIG
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only text content parts are supported, got type {v!r}")
        return v


Content = str | list[TextPart]


class _Message(BaseModel):
    model_config = _CONFIG
    name: str | None = None

    def text(self) -> str:
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if any(part.text is None for part in content):
            raise ValueError("a text content part needs its text")
        return "".join(part.text for part in content)

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}  # type: ignore[attr-defined]
        if self.name is not None:
            msg["name"] = self.name
        return msg


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content  # OpenAI lets tool_calls replace it; kvflow has no tools yet (refused below)


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def template_dict(self) -> dict[str, Any]:
        return {**super().template_dict(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]
_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(v: Any) -> Any:
    """Clear errors, naming the field, for what OpenAI refuses in messages (before pydantic's union
    errors would say it less plainly): an object per message, a known role, content where the
    role needs it. Raises APIError (pydantic lets it through) so the error names the exact field."""
    if not isinstance(v, list):
        return v

    def bad(i: int, field: str | None, message: str) -> APIError:
        param = f"messages.{i}" + (f".{field}" if field else "")
        code = "missing_required_parameter" if "required" in message else "invalid_value"
        return APIError(400, f"messages[{i}]{'.' + field if field else ''} {message}", param=param, code=code)

    if len(v) > MAX_MESSAGES:
        raise APIError(400, f"messages holds {len(v)} messages; at most {MAX_MESSAGES} are allowed",
                       param="messages", code="invalid_value")
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(i, None, "must be an object with a role and content")
        role = m.get("role")
        if role is None:
            raise bad(i, "role", "is required")
        if role not in _ROLES:
            raise bad(i, "role", f"must be one of {', '.join(_ROLES)}; got {str(role)[:40]!r}")
        for field in ("tool_calls", "function_call"):
            if m.get(field) is not None:
                raise bad(i, field, "is not supported yet (kvflow has no tool calling)")
        if m.get("content") is None:
            raise bad(i, "content", f"is required for a {role} message")
        if role == "tool" and m.get("tool_call_id") is None:
            raise bad(i, "tool_call_id", "is required for a tool message")
    return v


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None  # default: up to the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # Known to OpenAI, not implemented yet: refused with 400 rather than silently ignored.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v: Any) -> Any:
        return check_messages(v)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format of type {kind!r} is not supported yet (only 'text')")
        for name in ("tools", "functions", "function_call"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported yet")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported yet (only 'none')")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v: Any) -> Any:
        return check_messages(v)


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
