"""What /v1/completions and /v1/chat/completions share: the model check, tokenization, adding
requests to the engine, and logprobs in both OpenAI formats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestHandle
from kvflow.entrypoints.openai.utils import APIError, abort_all, safe_logprob, value_error
from kvflow.outputs import Logprob
from kvflow.sampling_params import SamplingParams

RETRY_AFTER_S = "1"


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.tokenizer = llm.tokenizer

    def model_name(self, requested: str | None) -> str:
        if requested is not None and requested != self.served_model_name:
            raise APIError(404, f"the model `{requested}` does not exist; this server serves "
                                f"`{self.served_model_name}`", param="model", code="model_not_found")
        return self.served_model_name

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

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors, raise_exception() in the template
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    # ---- requests ----------------------------------------------------------------------------------
    async def add_requests(self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                           prompt_param: str, arrival_time: float) -> list[RequestHandle]:
        """Add one engine request per prompt; all or none (a failure aborts those already added)."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            *(self.llm.add_request(rid, p, params, arrival_time=arrival_time) for rid, p in zip(ids, prompts)),
            return_exceptions=True)
        handles = [r for r in results if isinstance(r, RequestHandle)]
        errors = [r for r in results if not isinstance(r, RequestHandle)]
        if not errors:
            return handles
        abort_all(handles)
        err = errors[0]
        if isinstance(err, ValueError):
            raise value_error(err, prompt_param)
        if isinstance(err, EngineOverloadedError):
            raise APIError(503, str(err), code="overloaded", headers={"Retry-After": RETRY_AFTER_S})
        if isinstance(err, EngineDeadError):
            raise APIError(503, str(err), code="engine_dead")
        raise err


def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise value_error(e) from None


def now_s() -> int:
    return int(time.time())


def token_str(token_id: int, lp: Logprob | None, decode: Callable[[list[int]], str]) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode([token_id])


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num: int, offset: int,
                        decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """OpenAI's legacy format: tokens, token_logprobs, top_logprobs (top `num` plus the sampled
    token), text_offset (character offsets, starting at `offset`)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry.get(tid)
        s = token_str(tid, chosen, decode)
        tokens.append(s)
        token_logprobs.append(None if chosen is None else safe_logprob(chosen.logprob))
        top = {}
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= num or t == tid:
                top.setdefault(token_str(t, lp, decode), safe_logprob(lp.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num: int,
                  decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry.get(tid)
        s = token_str(tid, chosen, decode)
        top = [{"token": (ts := token_str(t, lp, decode)), "logprob": safe_logprob(lp.logprob),
                "bytes": list(ts.encode("utf-8"))}
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= num][:num]
        content.append({"token": s, "logprob": safe_logprob(chosen.logprob) if chosen else -9999.0,
                        "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}
