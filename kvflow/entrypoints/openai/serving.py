"""What /v1/completions and /v1/chat/completions share: the model check, tokenization, adding
requests to the engine, and logprobs in both OpenAI formats."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestHandle
from kvflow.engine.detokenizer import TokenBytes
from kvflow.entrypoints.openai.utils import REQUEST_ID_HEADER, APIError, abort_all, safe_logprob, value_error
from kvflow.lora.request import LoRARequest
from kvflow.models.chat_template import template_kwargs
from kvflow.outputs import Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.tracing import INCOMING_TRACE, Tracer

RETRY_AFTER_S = "1"
_TRACE_TASKS: set[asyncio.Task] = set()


class OpenAIServing:
    # --otlp-traces-endpoint: a span per engine request (set by build_app; None: off)
    tracer: Tracer | None = None
    # --served-model-name's other names, which requests may send too (set by build_app)
    aliases: tuple[str, ...] = ()
    trace_role = "engine"

    def __init__(self, llm: AsyncLLM, served_model_name: str) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.tokenizer = llm.tokenizer
        self.token_bytes = None if llm.tokenizer is None else TokenBytes(llm.tokenizer)

    def model_name(self, requested: str | None, allow_lora: bool = False) -> str:
        """The model a request names: the served model (by any of its names; the first is
        returned), or (`allow_lora`) a loaded LoRA adapter."""
        if requested is not None and requested != self.served_model_name and requested not in self.aliases:
            if allow_lora and requested in self.loras():
                return requested
            others = "".join(f", `{n}`" for n in (*self.aliases, *self.loras()))
            raise APIError(
                404,
                f"the model `{requested}` does not exist; this server serves `{self.served_model_name}`{others}",
                param="model",
                code="model_not_found",
            )
        return self.served_model_name

    def loras(self) -> dict[str, LoRARequest]:
        """The loaded LoRA adapters by name (changed only in the engine thread, between steps)."""
        return getattr(self.llm.engine, "loras", {})

    def lora_of(self, model: str) -> LoRARequest | None:
        """The adapter a request's resolved `model` names (None: the base model)."""
        return None if model == self.served_model_name else self.loras().get(model)

    def _trace(self, out: RequestOutput, carrier: dict[str, str] | None) -> None:
        """A finished request's span, with its step records (read between engine steps)."""

        async def record() -> None:
            rid = out.request_id
            try:
                steps = await self.llm.call(lambda e: e.explain_request(rid))
            except Exception:  # the engine is gone: the span without its steps
                steps = None
            self.tracer.record_request(out, carrier, steps, self.trace_role)

        task = asyncio.get_running_loop().create_task(record())
        _TRACE_TASKS.add(task)  # (a task nobody holds may be collected before it ran)
        task.add_done_callback(_TRACE_TASKS.discard)

    # ---- tokens ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool, param: str = "prompt") -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids", param=param)
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, str]] | None = None,
        template: str | None = None,
    ) -> str:
        """The conversation as the model's template renders it; `variables`: the request's
        `chat_template_kwargs` (kvflow.models.chat_template.template_kwargs);
        `continue_final_message`: ending inside the last message, as transformers renders it;
        `documents`: for a template that renders them (transformers' `documents`); `template`: a
        request's own chat template instead of the model's."""
        tok = self.tokenizer
        if tok is None or (template is None and not getattr(tok, "chat_template", None)):
            raise APIError(
                400,
                "this model has no chat template; use /v1/completions (or start the server with --chat-template)",
                param="messages",
            )
        try:
            extra = template_kwargs(variables)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs", code="invalid_value") from None
        try:
            return tok.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **({"continue_final_message": True} if continue_final_message else {}),
                **({"documents": documents} if documents else {}),
                **({"chat_template": template} if template is not None else {}),
                **extra,
            )
        except Exception as e:  # jinja errors, raise_exception() in the template
            param = "messages" if template is None else "chat_template"
            raise APIError(400, f"the chat template rejected the messages: {e}", param=param) from None

    # ---- requests ----------------------------------------------------------------------------------
    def with_model_defaults(self, params: SamplingParams, req: Any) -> SamplingParams:
        """`params` with the model's default sampling parameters (--generation-config) for the
        fields the request `req` (a pydantic model) left out or sent as null, as vLLM applies a
        model's generation_config.json. The sampling fields share their names across the APIs."""
        given = {name for name in req.model_fields_set if getattr(req, name, None) is not None}
        defaults = {k: v for k, v in self.llm.engine.default_sampling.items() if k not in given}
        return dataclasses.replace(params, **defaults) if defaults else params

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        prompt_param: str,
        arrival_time: float,
        client: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestHandle]:
        """Add one engine request per prompt; all or none (a failure aborts those already added)."""
        limit = self.llm.max_waiting_requests
        if limit is not None and params.n * len(prompts) > limit:
            # Never admissible, however idle the server: the client's error, not an overload.
            raise APIError(
                400,
                f"n ({params.n}) x {len(prompts)} prompts = {params.n * len(prompts)} sequences "
                f"exceeds the server's max_waiting_requests ({limit})",
                param="n",
                code="invalid_value",
            )
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            *(
                self.llm.add_request(
                    rid,
                    p,
                    params,
                    arrival_time=arrival_time,
                    client=client,
                    lora_request=lora_request,
                    cache_salt=cache_salt,
                )
                for rid, p in zip(ids, prompts)
            ),
            return_exceptions=True,
        )
        handles = [r for r in results if isinstance(r, RequestHandle)]
        errors = [r for r in results if not isinstance(r, RequestHandle)]
        if not errors:
            if self.tracer is not None:
                carrier = INCOMING_TRACE.get()
                for h in handles:
                    h.on_finished = functools.partial(self._trace, carrier=carrier)
            return handles
        abort_all(handles)
        err = errors[0]
        if isinstance(err, ValueError):
            raise value_error(err, prompt_param)
        if isinstance(err, EngineOverloadedError):
            retry = str(max(1, math.ceil(err.retry_after_s)))
            raise APIError(503, str(err), code="overloaded", headers={"Retry-After": retry})
        if isinstance(err, EngineDeadError):
            raise APIError(503, str(err), code="engine_dead")
        raise err


def request_id_of(raw: Any, prefix: str) -> str:
    """The id of an HTTP request's engine requests (and of its response): `prefix-` and the
    client's X-Request-Id header, as vLLM takes it (so logs, traces and /debug/requests/{id} carry
    the client's own id), else a random one. Two requests in flight under one id: the second is a
    400 (the engine's)."""
    given = raw.headers.get("x-request-id")
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not REQUEST_ID_HEADER.fullmatch(given):
        raise APIError(400, "the X-Request-Id header must be 1 to 128 letters, digits or '._:-'", code="invalid_value")
    return f"{prefix}-{given}"


def client_of(raw: Any, user: str | None) -> str | None:
    """Who sent a request, for fair sharing: OpenAI's `user`, else the API key (by a digest, so
    the key itself is not kept), else nobody in particular."""
    if user:
        return f"user:{user}"
    auth = raw.headers.get("authorization")
    if auth:
        import hashlib

        return "key:" + hashlib.sha256(auth.encode()).hexdigest()[:16]
    return None


def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise value_error(e) from None


def expert_trace_fields(c: Any) -> dict[str, Any]:
    """{"expert_trace": ...} for a finished choice whose request asked for one (kvflow's
    return_expert_trace), else nothing."""
    trace = getattr(c, "expert_trace", None)
    return {} if trace is None else {"expert_trace": trace.to_dict()}


def now_s() -> int:
    return int(time.time())


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    num: int,
    offset: int,
    tokens: TokenBytes | None,
    start: int = 0,
    as_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's legacy format for tokens [start:] of a completion: tokens, token_logprobs,
    top_logprobs (top `num` plus the sampled token), text_offset (the characters of the text
    before each token, from `offset`; a token ending inside a character moves it by nothing).
    Offsets count from the completion's first token, so a stream gets the same ones. `as_ids`:
    tokens named `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    out_tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, (tid, entry) in enumerate(zip(token_ids, logprobs)):
        if i >= start:
            chosen = entry.get(tid)
            out_tokens.append(_token_text(tid, chosen, tokens, as_ids))
            token_logprobs.append(None if chosen is None else safe_logprob(chosen.logprob))
            top = {}
            for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
                if lp.rank <= num or t == tid:
                    top.setdefault(_token_text(t, lp, tokens, as_ids), safe_logprob(lp.logprob))
            top_logprobs.append(top)
            text_offset.append(offset)
        offset += len(utf8.decode(tokens.bytes(tid))) if tokens is not None else 0
    return {
        "tokens": out_tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def echoed_logprobs(
    prompt_ids: list[int],
    prompt_logprobs: list[dict[int, Logprob] | None],
    num: int,
    tokens: TokenBytes | None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy format): the first
    token has none (token_logprobs and top_logprobs null); offsets count from the prompt's start."""
    lp = completion_logprobs(prompt_ids, [e or {} for e in prompt_logprobs], num, 0, tokens, as_ids=as_ids)
    if lp["top_logprobs"]:
        lp["top_logprobs"][0] = None
    return lp


def prompt_logprobs_field(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} with the token and the top N."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": safe_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    num: int,
    tokens: TokenBytes | None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}; `bytes`
    are the token's own (a piece of a multi-byte character included), `token` is its text or, for
    such a piece, `bytes:\\xe3\\x81` (`as_ids`: `token_id:N`, vLLM's return_tokens_as_token_ids)."""

    def entry_of(t: int, lp: Logprob | None) -> dict[str, Any]:
        return {
            "token": _token_text(t, lp, tokens, as_ids),
            "logprob": safe_logprob(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(tokens.bytes(t)) if tokens is not None else [],
        }

    content = []
    for tid, entry in zip(token_ids, logprobs):
        top = [entry_of(t, lp) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= num][:num]
        content.append({**entry_of(tid, entry.get(tid)), "top_logprobs": top})
    return {"content": content}


def _token_text(token_id: int, lp: Logprob | None, tokens: TokenBytes | None, as_id: bool = False) -> str:
    if as_id:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokens.text(token_id) if tokens is not None else ""
