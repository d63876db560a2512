"""`use_beam_search` in /v1/completions and /v1/chat/completions: each prompt's search
(kvflow.beam_search) runs as one engine request per beam and step, behind a handle that the
endpoints consume as they consume an engine request's: its one output, finished, holds the beams
best first as the choices (so streamed, every choice comes whole in one chunk, as vLLM streams
beam search)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvflow.beam_search import BeamSearch, BeamSearchParams
from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.engine.llm_engine import truncate_prompt
from kvflow.entrypoints.openai.serving import OpenAIServing
from kvflow.entrypoints.openai.utils import APIError, abort_all, last_output, value_error
from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams


class BeamSearchHandle:
    """One prompt's search: `async for` yields its finished RequestOutput (RequestFailedError if a
    step's request failed); `abort()` ends the search and aborts the step running."""

    def __init__(
        self,
        serving: OpenAIServing,
        request_id: str,
        search: BeamSearch,
        step: SamplingParams,
        first: RequestHandle,
        add: dict,
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.search = search
        self.step = step
        self.handles: list[RequestHandle] = [first]
        self.add = add  # add_requests' other arguments (prompt_param, arrival time, client, ...)
        self._aborted = False
        self._consumed = False

    def abort(self) -> None:
        self._aborted = True
        abort_all(self.handles)

    def __aiter__(self) -> BeamSearchHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._consumed:
            raise StopAsyncIteration
        self._consumed = True
        try:
            n = 0
            while True:
                tops = []
                for h in self.handles:
                    last = await last_output(h)
                    if self._aborted:
                        raise RequestFailedError("the beam search was aborted")
                    if not last.outputs or not last.outputs[0].logprobs:
                        raise RequestFailedError(f"beam search step request {h.request_id} returned no token")
                    tops.append(last.outputs[0].logprobs[0])
                self.search.advance(tops)
                if self.search.done:
                    break
                n += 1
                try:
                    self.handles = await self.serving.add_requests(
                        f"{self.request_id}-{n}", self.search.pending(), self.step, **self.add
                    )
                except APIError as e:  # (a later step: the response has begun, so no status of its own)
                    raise RequestFailedError(f"beam search step {n}: {e.message}") from None
        finally:
            abort_all(self.handles)
        return self._output()

    def _output(self) -> RequestOutput:
        result = self.search.result(self.serving.tokenizer)
        keep_logprobs = self.search.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=i,
                text=s.text or "",
                token_ids=s.tokens,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs if keep_logprobs else None,
            )
            for i, s in enumerate(result.sequences)
        ]
        now = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=result.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=RequestMetrics(arrival_time=self.add["arrival_time"], finished_time=now),
        )


async def start_requests(
    serving: OpenAIServing,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    beams: BeamSearchParams | None,
    prompt_param: str,
    arrival_time: float,
    client: str | None = None,
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
) -> list[RequestHandle] | list[BeamSearchHandle]:
    """A request's handles, one per prompt: its engine requests (`beams` None) or a beam search per
    prompt with its first step added, so that bad input is the request's 400 and a full queue its
    503 either way. With a search, `params` (the request's) gives the priority and
    truncate_prompt_tokens."""
    add = dict(
        prompt_param=prompt_param,
        arrival_time=arrival_time,
        client=client,
        lora_request=lora_request,
        cache_salt=cache_salt,
    )
    if beams is None:
        return await serving.add_requests(request_id, prompts, params, **add)
    engine = serving.llm.engine
    limit = serving.llm.max_model_len
    try:
        searches = [
            BeamSearch(
                truncate_prompt(p, params.truncate_prompt_tokens, limit),
                beams,
                engine.eos_token_ids,
                limit,
                engine.max_logprobs,
            )
            for p in prompts
        ]
    except ValueError as e:
        if str(e).startswith("beam_width"):  # (the request's beam width is its n)
            raise APIError(400, str(e), param="n", code="invalid_value") from None
        raise value_error(e, prompt_param) from None
    step = searches[0].step_params(params)
    first = await serving.add_requests(request_id, [s.pending()[0] for s in searches], step, **add)
    ids = [h.request_id for h in first]
    return [BeamSearchHandle(serving, rid, s, step, h, add) for rid, s, h in zip(ids, searches, first)]
