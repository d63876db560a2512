"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to `SamplingParams`.

Responses are plain dicts built by the serving modules (their shapes follow OpenAI's API reference).
Unknown fields are ignored, as OpenAI and vLLM do; fields OpenAI or vLLM know and kvflow does not
implement are refused with 400 naming them whenever they ask for something. Ranges are checked by
`SamplingParams` so that the offline API and the server report the same limits; pydantic checks
types (strictly: JSON Schema's rules), the per-role message rules and the limits that exist only on
the wire (top_logprobs, n, list lengths).
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, field_validator, model_validator

from kvflow.beam_search import BeamSearchParams
from kvflow.entrypoints.openai.utils import APIError
from kvflow.models.chat_template import check_continuation
from kvflow.sampling_params import MAX_N, SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams
from kvflow.utils.validation import is_int

# Limits of the wire only (docs/serving.md lists them with SamplingParams' own).
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_MESSAGES = 1024  # messages in one chat request
MAX_TOOLS = 128  # tools in one chat request (OpenAI's limit)
MAX_DOCUMENTS = 256  # documents in one chat request
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024  # a request's own chat template (with --trust-request-chat-template)
# Strict types: a JSON string is never taken for a number, nor true for 1 (JSON Schema's rules,
# so the OpenAPI schema says exactly what is accepted). Unknown fields are ignored, as OpenAI does.
_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = _CONFIG
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.schema_)


def _wire_model(cls: type, name: str) -> type[BaseModel]:
    """A strict pydantic model with the fields of an options dataclass: the dataclass stays the
    one definition (and validates in its __post_init__); this only checks the JSON types."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls) if f.metadata.get("wire", True)
    }
    with warnings.catch_warnings():  # a field called "json" shadows BaseModel.json: harmless here
        warnings.simplefilter("ignore")
        return create_model(name, __config__=_CONFIG, **fields)


# vLLM's `structured_outputs` extra: exactly one of the constraints (StructuredOutputsParams' fields).
StructuredOutputsRequest = _wire_model(StructuredOutputsParams, "StructuredOutputsRequest")
_GUIDED = ("json", "regex", "choice", "grammar")  # guided_<kind>: vLLM's earlier names of these constraints


# vLLM's request extras that kvflow does not implement, with the values that ask for nothing
# (which pass): any other value is refused with 400, since ignored the answer would look right
# and not be what was asked.
_UNSUPPORTED_EXTRAS: dict[str, tuple[Any, ...]] = {
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}

# SamplingParams fields that beam search cannot honour (kvflow.beam_search), with the values that
# ask for nothing: any other is refused with use_beam_search.
_NOT_WITH_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "seed": (None,),
    "stop": ([],),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "prompt_logprobs": (None,),
    "kv_transfer_params": (None,),
    "return_expert_trace": (False,),
    "ttft_slo_ms": (None,),
    "tpot_slo_ms": (None,),
}


def _refuse_extras(body: Any, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    if isinstance(body, dict):
        for name, idle in unsupported.items():
            if name in body and not any(type(body[name]) is type(v) and body[name] == v for v in idle):
                raise ValueError(f"{name} is not supported (vLLM's extra); leave it out")
    return body


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _CONFIG

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        return _refuse_extras(body, _UNSUPPORTED_EXTRAS)

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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: each chunk's new
    # ids, the prompt's on a choice's first chunk with output)
    return_token_ids: bool = False
    # vLLM's: logprobs name each token `token_id:N` (text that is not whole characters stays exact)
    return_tokens_as_token_ids: bool = False
    # vLLM's: only requests with the same salt share prefix-cache blocks
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # type: ignore[valid-type]
    # vLLM's fields before `structured_outputs` (removed in vLLM 0.12, still sent by older
    # clients): taken as structured_outputs' json / regex / choice / grammar rather than ignored,
    # which would return unconstrained text as if the constraint held
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused: see _constraint
    guided_decoding_backend: str | None = None  # accepted and unused: one backend serves every constraint
    # scheduling extras: vLLM's priority (lower first), per-request SLOs
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # prefill/decode disaggregation, vLLM's extra: {"do_remote_decode": true} to a prefill engine; what
    # its response returned, to a decode engine. Opaque here: SamplingParams and the engine check it.
    kv_transfer_params: dict[str, Any] | None = None
    # kvflow's: with a Mixture-of-Experts model, each finished choice carries "expert_trace" (the
    # experts each token was routed to, per MoE layer, and the distance since each was last active)
    return_expert_trace: bool = False
    # vLLM's extra: every prompt token's logprob with this many top logprobs ("prompt_logprobs" on
    # a completion's choices, at the top of a chat completion); not with stream, as vLLM
    prompt_logprobs: int | None = None
    # vLLM's extras: beam search with beam width n (kvflow.beam_search), scored with this penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true")
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
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=self._logit_bias(),
            structured_outputs=self._constraint(),
            priority=self.priority,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
            kv_transfer_params=self.kv_transfer_params,
            return_expert_trace=self.return_expert_trace,
        )

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """With use_beam_search, the search's parameters (beam width n) taken from the request's
        validated `params`; None without. Fields that shape sampling have no meaning when beams
        are ranked by the model's log-probabilities: given, they are refused, not ignored."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies only to beam search (use_beam_search: true)")
            return None
        if self.temperature not in (None, 0, 1):
            raise ValueError(
                "temperature does not apply to beam search (beams are ranked by the model's "
                "log-probabilities); leave it out or give 0"
            )
        for name, idle in _NOT_WITH_BEAM_SEARCH.items():
            if getattr(params, name) not in idle:
                if name == "structured_outputs":
                    name = self.constraint_field or "response_format"
                elif name == "prompt_logprobs" and self.prompt_logprobs is None:
                    name = "echo with logprobs"  # (the prompt's logprobs an echo asks for)
                raise ValueError(f"{name} cannot be combined with use_beam_search; leave it out")
        return BeamSearchParams(
            beam_width=params.n,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            length_penalty=self.length_penalty,
            min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids or []),
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=params.logprobs,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's map of token id (as a JSON string key) to bias; the range is SamplingParams'."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
            bias[int(key)] = value
        return bias

    def _constraint(self) -> StructuredOutputsParams | None:
        if self.guided_whitespace_pattern is not None:
            raise ValueError(
                "guided_whitespace_pattern is not supported; structured_outputs.disable_any_whitespace "
                "gives JSON without free whitespace"
            )
        legacy = self._guided()
        given = ["guided_" + kind for kind in legacy]
        if self.structured_outputs is not None:
            given.insert(0, "structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} cannot be combined; give one constraint")
        if legacy:
            ((kind, value),) = legacy.items()
            try:
                return StructuredOutputsParams(**{kind: value})
            except ValueError as e:
                raise ValueError(f"guided_{kind} (structured_outputs.{kind}): {e}") from None
        if self.structured_outputs is not None:
            return StructuredOutputsParams(**self.structured_outputs.model_dump())
        return self.response_format.constraint() if self.response_format is not None else None

    @property
    def constraint_field(self) -> str | None:
        """The field holding a constraint other than response_format (structured_outputs or a
        guided_* one), if the request has one."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        return next(("guided_" + kind for kind in self._guided()), None)

    def _guided(self) -> dict[str, Any]:
        """The guided_<kind> fields given, by kind."""
        return {kind: v for kind in _GUIDED if (v := getattr(self, "guided_" + kind)) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: each chunk's `usage` the counts so far (not null)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


Prompt = str | list[int]
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
    ]
}


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
        if self.kv_transfer_params is not None and len(self.prompt) != 1:
            # One transfer describes one prompt's KV: several engine requests cannot share it.
            raise ValueError(f"kv_transfer_params needs a single prompt, got {len(self.prompt)} prompts")
        # echo with logprobs: the prompt's tokens lead the logprobs, as OpenAI's legacy completions
        echoed = max(self.logprobs, self.prompt_logprobs or 0) if self.echo and self.logprobs is not None else None
        return self._sampling(self.max_tokens, self.logprobs, echoed)


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
    if all(is_int(x) for x in v):
        return [list(v)]
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"prompt holds {len(v)} prompts; at most {MAX_PROMPTS} are allowed in one request")
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(isinstance(x, list) and all(is_int(t) for t in x) for x in v):
        if any(not x for x in v):
            raise ValueError("prompt must not contain an empty token list")
        return [list(x) for x in v]
    raise ValueError(shape)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: `input` as completions' `prompt` (a string, strings, token ids or lists
    of them; at most MAX_PROMPTS inputs). `dimensions` is accepted only as the model's hidden size;
    `user` is ignored (fair sharing aside)."""

    model_config = _CONFIG
    input: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]  # required; see parse_prompts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's extra

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, v: Any) -> list[Prompt]:
        try:
            return parse_prompts(v)
        except ValueError as e:
            raise ValueError(str(e).replace("prompt", "input")) from None


def _texts(v: Any, name: str) -> list[str]:
    """A string or a non-empty list of strings (at most MAX_PROMPTS), as /score and /rerank take them."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise ValueError(f"{name} must be a string or a list of strings")
    if not v:
        raise ValueError(f"{name} must not be empty")
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"{name} holds {len(v)} texts; at most {MAX_PROMPTS} are allowed in one request")
    return list(v)


class ScoreRequest(BaseModel):
    """POST /score (vLLM's): the similarity of text_1 and text_2, one text against each of a list
    or pairwise; with an embedding model, the cosine of their embeddings (kvflow.entrypoints.scoring)."""

    model_config = _CONFIG
    model: str | None = None
    text_1: Annotated[
        Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
    ]
    text_2: Annotated[
        Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
    ]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _check_texts(cls, v: Any, info: Any) -> list[str]:
        return _texts(v, info.field_name)


class RerankDocument(BaseModel):
    model_config = _CONFIG
    text: str


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's; Jina's and Cohere's shape): the documents
    ranked by their score against the query, best first, the first top_n of them (0 or null:
    all)."""

    model_config = _CONFIG
    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_PROMPTS)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


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


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    model_config = _CONFIG
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None  # may be absent when tool_calls are given
    tool_calls: list[AssistantToolCall] | None = None

    def template_dict(self) -> dict[str, Any]:
        msg = super().template_dict()
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return msg


def _arguments(text: str) -> Any:
    """Templates index into the arguments (`arguments.items()`): give them the object when the
    text is one."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def template_dict(self) -> dict[str, Any]:
        return {**super().template_dict(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
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
        raise APIError(
            400,
            f"messages holds {len(v)} messages; at most {MAX_MESSAGES} are allowed",
            param="messages",
            code="invalid_value",
        )
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(i, None, "must be an object with a role and content")
        role = m.get("role")
        if role is None:
            raise bad(i, "role", "is required")
        if role not in _ROLES:
            raise bad(i, "role", f"must be one of {', '.join(_ROLES)}; got {str(role)[:40]!r}")
        if m.get("function_call") is not None:
            raise bad(i, "function_call", "is deprecated and not supported; use tool_calls")
        if m.get("tool_calls") is not None and role != "assistant":
            raise bad(i, "tool_calls", "is only allowed in assistant messages")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad(
                i,
                "content",
                f"is required for a {role} message" + (" without tool_calls" if role == "assistant" else ""),
            )
        if role == "tool" and m.get("tool_call_id") is None:
            raise bad(i, "tool_call_id", "is required for a tool message")
    return v


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None  # default: up to the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # (its limit: the engine's --max-logprobs)
    add_generation_prompt: bool = True
    # vLLM's extras: the template goes on with the last (assistant) message instead of opening a
    # new one; the special tokens (BOS) added to the rendered text, which usually holds them
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # vLLM's extra: the answer's content begins with the last message's when that is the
    # assistant's (with continue_final_message: the whole message)
    echo: bool = False
    # vLLM's extra: more variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extra: documents for a template that renders them (RAG templates: Command-R, Granite)
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    # vLLM's extra: this request's own chat template (a server started with
    # --trust-request-chat-template only; refused otherwise, as vLLM)
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: refused with 400 rather than silently ignored.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v: Any) -> Any:
        return check_messages(v)

    def to_sampling_params(self) -> SamplingParams:
        check_continuation(self.add_generation_prompt, self.continue_final_message, self.messages[-1].role)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise ValueError(f"{name} is deprecated and not supported; use tools and tool_choice")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names the function {name[:64]!r}, which is not among the tools")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    @property
    def echoed(self) -> str:
        """What `echo` puts before the answer: the last message's text if it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: as a chat request's
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v: Any) -> Any:
        return check_messages(v)


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
