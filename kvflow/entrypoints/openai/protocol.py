"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to `SamplingParams`.

Responses are plain dicts built by the serving modules (their shapes follow OpenAI's API reference).
Unknown fields are ignored, as vLLM does. Ranges are checked by `SamplingParams` so that the
offline API and the server report the same limits; pydantic only checks types and the few limits
that exist only on the wire (top_logprobs, n).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvflow.sampling_params import SamplingParams

MAX_N = 128


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

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
            raise ValueError("logit_bias is not supported")
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
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    prompt: Any  # required; see parse_prompts
    max_tokens: int | None = 16  # OpenAI's default; null: up to the context
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
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
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(_is_token(x) for x in v):
        return [list(v)]
    if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in v):
        if any(not x for x in v):
            raise ValueError("prompt must not contain an empty token list")
        return [list(x) for x in v]
    raise ValueError(shape)


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # default: up to the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
