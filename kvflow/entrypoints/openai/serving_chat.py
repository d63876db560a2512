"""POST /v1/chat/completions: messages through the model's chat template, with OpenAI tools.

With tools (and tool_choice other than "none"), the server's tool-call format (`--tool-call-parser`)
decides the prompt (the template's own `tools=` where the template knows tools, else the generic
protocol's system message), the constraint (`required` and named choices always produce a call
whose arguments follow the tool's schema; with `auto` and response_format, calls or the schema's
JSON), and how the output text becomes `message.tool_calls` (one parser, streamed or not, so both
answers are the same calls, content and finish_reason).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.entrypoints.openai.beam_search import start_requests
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.reasoning_parsers import ReasoningFormat, get_reasoning_format
from kvflow.entrypoints.openai.serving import (
    OpenAIServing,
    chat_logprobs,
    client_of,
    expert_trace_fields,
    now_s,
    prompt_logprobs_field,
    request_id_of,
    sampling_params,
)
from kvflow.entrypoints.openai.tool_parsers import (
    StreamingToolParser,
    ToolCall,
    ToolCallFormat,
    generic_system_prompt,
    get_tool_format,
    make_tool_call_id,
)
from kvflow.entrypoints.openai.utils import (
    SSE_DONE,
    APIError,
    OwnedStreamingResponse,
    finish_unstreamed,
    kv_transfer_fields,
    last_output,
    merge_handles,
    parse_body,
    sse,
    sse_error,
    usage,
    value_error,
)
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams


class ServingChat(OpenAIServing):
    def __init__(
        self,
        llm,
        served_model_name: str,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        super().__init__(llm, served_model_name)
        self.trust_request_chat_template = trust_request_chat_template
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = get_tool_format(tool_call_parser, template if isinstance(template, str) else None)
        self.reasoning: ReasoningFormat | None = get_reasoning_format(reasoning_parser)

    def constrain_after_reasoning(self, params: SamplingParams) -> None:
        """With --reasoning-parser, a constraint (response_format, structured_outputs, the tool grammar)
        applies after the think block: the grammar allows the reasoning's free text first. A
        constraint that itself writes the end tag (a structured_outputs regex or grammar spelling out
        the think block) is left as it is."""
        constraint = params.structured_outputs
        if self.reasoning is not None and constraint is not None and self.reasoning.end not in constraint.text:
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, reasoning_prefix=self.reasoning.grammar_prefix()
            )

    def chat_prompt_ids(self, req: ChatCompletionRequest, tools: ToolCallFormat | None = None) -> list[int]:
        try:
            conversation = req.conversation()
        except ValueError as e:
            raise value_error(e, "messages") from None
        template_tools = None
        if tools is not None and tools.uses_template_tools:
            template_tools = req.tool_dicts()
        elif tools is not None:
            conversation = _generic_conversation(conversation, tools, req)
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template in a request is refused: this server was not started with --trust-request-chat-template",
                param="chat_template",
                code="invalid_value",
            )
        text = self.apply_chat_template(
            conversation,
            req.add_generation_prompt,
            tools=template_tools,
            variables=req.chat_template_kwargs,
            continue_final_message=req.continue_final_message,
            documents=req.documents,
            template=req.chat_template,
        )
        # The template usually holds the special tokens (BOS etc.): not added again unless asked.
        return self.tokenize(text, add_special_tokens=req.add_special_tokens, param="messages")

    def tool_format_for(self, req: ChatCompletionRequest, params: SamplingParams) -> ToolCallFormat | None:
        """The tool-call format when this request uses tools; constrains `params` to the tool
        grammar. With response_format as well (OpenAI takes both: the model calls a tool or answers
        in the schema), one grammar enforces both: calls in the tool format, or the schema's JSON."""
        if not req.tools or req.effective_tool_choice == "none":
            return None
        if (field := req.constraint_field) is not None:
            raise APIError(
                400,
                f"{field} cannot be combined with tools (unless tool_choice is none); "
                "use response_format, which applies to the answer when the model calls no tool",
                param=field,
                code="invalid_value",
            )
        fmt = self.tool_format
        schema = response_schema(params.structured_outputs)
        try:
            tag = fmt.structural_tag(req.tool_dicts(), req.effective_tool_choice, req.parallel_tool_calls, schema)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", param="tools", code="invalid_value") from None
        if tag is not None:
            params.structured_outputs = StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))
        return fmt.with_response_schema(schema) if schema is not None else fmt

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ChatCompletionRequest)
        model = self.model_name(req.model, allow_lora=True)
        params = sampling_params(req.to_sampling_params)
        beams = sampling_params(lambda: req.beam_search_params(params))
        if beams is None:
            params = self.with_model_defaults(params, req)
        tools = self.tool_format_for(req, params)
        if beams is not None and tools is not None:
            raise APIError(400, "tools cannot be combined with use_beam_search", param="tools", code="invalid_value")
        self.constrain_after_reasoning(params)
        prompt_ids = self.chat_prompt_ids(req, tools)
        request_id = request_id_of(raw, "chatcmpl")
        handles = await start_requests(
            self,
            request_id,
            [prompt_ids],
            params,
            beams,
            "messages",
            arrival,
            client_of(raw, req.user),
            self.lora_of(model),
            req.cache_salt,
        )
        created = now_s()
        if req.stream:
            return OwnedStreamingResponse(self._stream(request_id, model, created, req, handles, tools), handles)
        finals = await finish_unstreamed(raw, handles, last_output(handles[0]))
        if finals is None:
            return Response(status_code=499)  # the client closed the connection
        return JSONResponse(self._response(request_id, model, created, req, finals, tools))

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs) -> dict[str, Any] | None:
        if not req.logprobs or logprobs is None:
            return None
        return chat_logprobs(
            token_ids, logprobs, req.top_logprobs or 0, self.token_bytes, req.return_tokens_as_token_ids
        )

    def _response(
        self,
        request_id: str,
        model: str,
        created: int,
        req: ChatCompletionRequest,
        out: RequestOutput,
        tools: ToolCallFormat | None,
    ) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            message, reason = _message(c, tools, self.reasoning)
            if req.echoed:
                message["content"] = req.echoed + (message["content"] or "")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(req, c.token_ids, c.logprobs),
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                    **expert_trace_fields(c),
                    **({"token_ids": list(c.token_ids)} if req.return_token_ids else {}),
                }
            )
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(
                len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens
            ),
            **kv_transfer_fields([out]),
            **({} if req.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_field(out.prompt_logprobs)}),
            **({"prompt_token_ids": list(out.prompt_token_ids)} if req.return_token_ids else {}),
        }

    async def _stream(
        self,
        request_id: str,
        model: str,
        created: int,
        req: ChatCompletionRequest,
        handles: list[RequestHandle],
        tools: ToolCallFormat | None,
    ) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if req.include_usage else {}
        parsers = [StreamingToolParser(tools) if tools is not None else None for _ in range(req.n)]
        thinkers = [self.reasoning.streaming() if self.reasoning is not None else None for _ in range(req.n)]
        content_so_far = [""] * req.n  # after the reasoning: what the tool parser reads
        thought_of = [0] * req.n  # characters of the output the reasoning parser has read
        made_calls = [False] * req.n
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        finished = [False] * req.n
        n_prompt = cached = 0
        prompt_ids_sent = not req.return_token_ids
        try:
            for i in range(req.n):  # the role first, before any token
                yield sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        **extra,
                    }
                )
                if req.echoed:
                    choice = {"index": i, "delta": {"content": req.echoed}, "logprobs": None, "finish_reason": None}
                    yield sse({**base, "choices": [choice], **extra})
            async for _, out in merge_handles(handles):
                n_prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    delta: dict[str, Any] = {}
                    parser = parsers[i]
                    text = c.text[sent_text[i] :]
                    thinker = thinkers[i]
                    if thinker is not None:  # the think block first; the rest is content
                        thought, text = thinker.feed(c.text[thought_of[i] :], c.finished)
                        thought_of[i] = len(c.text)
                        if thought:
                            delta["reasoning_content"] = thought
                        content_so_far[i] += text
                    if parser is not None:  # tool calls: the parser decides what of the new text is content
                        whole = content_so_far[i] if thinker is not None else c.text
                        text, calls = parser.feed(whole, c.finished)
                        if calls:
                            delta["tool_calls"] = calls
                            made_calls[i] = True
                    if text:
                        delta["content"] = text
                    new_ids = c.token_ids[sent_tokens[i] :]
                    if not delta and not c.finished and not ((req.logprobs or req.return_token_ids) and new_ids):
                        continue
                    new_lps = c.logprobs[sent_tokens[i] :] if c.logprobs is not None else None
                    reason = "tool_calls" if made_calls[i] and c.finish_reason == "stop" else c.finish_reason
                    choice: dict[str, Any] = {
                        "index": i,
                        "delta": delta,
                        "logprobs": self._logprobs(req, new_ids, new_lps),
                        "finish_reason": reason,
                    }
                    final: dict[str, Any] = {}
                    if req.return_token_ids:
                        choice["token_ids"] = list(new_ids)
                        if not prompt_ids_sent:  # (on the first chunk with output: the engine's ids)
                            final["prompt_token_ids"] = list(out.prompt_token_ids)
                            prompt_ids_sent = True
                    if c.finished:
                        choice["stop_reason"] = c.stop_reason
                        choice.update(expert_trace_fields(c))
                        finished[i] = True
                        final.update(kv_transfer_fields([out]))  # on the chunk with finish_reason
                    sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    if req.continuous_usage:
                        extra = {"usage": usage(n_prompt, sum(sent_tokens), cached)}
                    yield sse({**base, "choices": [choice], **extra, **final})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": usage(n_prompt, sum(sent_tokens), cached)})
        except RequestFailedError as e:
            yield sse_error(str(e))
        yield SSE_DONE


def _message(
    c: CompletionOutput, tools: ToolCallFormat | None, reasoning: ReasoningFormat | None = None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of one finished completion, and its finish_reason. With a reasoning
    parser, the think block goes to reasoning_content and only the rest is read for tool calls."""
    text, thought = c.text, None
    if reasoning is not None:
        thought, text = reasoning.split(c.text)
    extra = {"reasoning_content": thought or None} if reasoning is not None else {}
    if tools is None:
        content = text or None if thought else text
        return {"role": "assistant", "content": content, **extra}, c.finish_reason
    parsed = tools.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, **extra}
    if not parsed.tool_calls:
        return message, c.finish_reason
    message["tool_calls"] = [
        {"id": make_tool_call_id(), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
        for t in parsed.tool_calls
    ]
    return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason


def response_schema(constraint: StructuredOutputsParams | None) -> dict[str, Any] | None:
    """The JSON schema response_format asks of an answer (json_object: any object), or None."""
    if constraint is None:
        return None
    if constraint.json_object:
        return {"type": "object"}
    assert isinstance(constraint.json, dict)  # response_format makes only these two kinds
    return constraint.json


def _generic_conversation(
    conversation: list[dict[str, Any]], fmt: ToolCallFormat, req: ChatCompletionRequest
) -> list[dict[str, Any]]:
    """For a template that knows nothing of tools: the tools and the reply protocol go into the
    system message, and earlier calls are written back as the text the protocol produces."""
    prompt = generic_system_prompt(
        req.tool_dicts(), req.effective_tool_choice, req.parallel_tool_calls, fmt.response_schema
    )
    out = []
    for m in conversation:
        if m.get("tool_calls"):
            calls = [
                ToolCall(c["function"]["name"], _arguments_text(c["function"]["arguments"])) for c in m["tool_calls"]
            ]
            m = {"role": "assistant", "content": fmt.history_text(calls)}
        out.append(m)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
