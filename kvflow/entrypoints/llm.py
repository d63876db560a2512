"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM.

A prompt is a string, a list of token ids, or vLLM's prompt dicts: `{"prompt": "..."}` (TextPrompt)
and `{"prompt_token_ids": [...]}` (TokensPrompt). `LLM` owns its engine's worker processes and
process groups: `shutdown()`, leaving a `with LLM(...) as llm:` block, and the object being
collected each release them (once), so a second engine in the same process starts clean.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvflow.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import EngineStats, LLMEngine
from kvflow.entrypoints.scoring import cosine, pair_indices
from kvflow.lora.request import LoRARequest
from kvflow.models.chat_template import check_continuation, template_kwargs
from kvflow.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvflow.sampling_params import SamplingParams

Prompt = str | list[int] | Mapping[str, Any]
# vLLM's prompt dict keys (one of them per prompt)
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_PROMPT_OPTIONS = ("cache_salt",)  # what a prompt dict may hold besides its prompt


def _prompt_of(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """The text or token ids a prompt (a string, token ids, or one of vLLM's prompt dicts) holds,
    and its dict's `cache_salt` (None: none)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS) - set(_PROMPT_OPTIONS))
    if unknown:
        raise ValueError(f"unsupported prompt key(s) {unknown}; a prompt dict holds one of {list(_PROMPT_KEYS)}")
    given = [k for k in _PROMPT_KEYS if k in prompt]
    if len(given) != 1:
        raise ValueError(f"a prompt dict holds exactly one of {list(_PROMPT_KEYS)}, got {sorted(prompt)}")
    salt = prompt.get("cache_salt")  # (checked by the engine, as the server's)
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and not (isinstance(value, list) and all(isinstance(t, int) for t in value)):
        raise ValueError("'prompt_token_ids' must be a list of integers")
    return value, salt


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        # Runs engine.shutdown at most once: from shutdown(), from __exit__, when this object is
        # collected, or at interpreter exit (the finalizer holds the engine, not the LLM).
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.engine)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's name for `tokenizer`)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter (engine started with enable_lora) every prompt runs
        under, or one per prompt (None: the base model)."""
        prompts = _as_list(prompts)
        parsed = [_prompt_of(p) for p in prompts]
        params, loras = _per_prompt(len(parsed), self._params_or_default(sampling_params), lora_request)
        return self._run([(p, sp, True, salt) for (p, salt), sp in zip(parsed, params)], use_tqdm, loras)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt, as vLLM's `LLM.beam_search` (kvflow.beam_search: HF
        transformers' selection rules): each prompt's `params.beam_width` best finished beams,
        best first. All prompts' beams run as one batch of one-token requests per step; prefix
        caching (on by default) keeps what the beams share."""
        prompts = _as_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        parsed = [_prompt_of(p) for p in prompts]
        _, loras = _per_prompt(len(parsed), None, lora_request)
        engine = self.engine
        searches = [
            BeamSearch(engine.tokenize(p), params, engine.eos_token_ids, engine.max_model_len, engine.max_logprobs)
            for p, _ in parsed
        ]
        step = searches[0].step_params() if searches else None
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(searches), desc="Beam search", unit="prompt", dynamic_ncols=True)
        try:
            while any(not s.done for s in searches):
                owners = [(i, seq) for i, s in enumerate(searches) for seq in s.pending()]
                outs = self._run(
                    [(seq, step, False, parsed[i][1]) for i, seq in owners], False, [loras[i] for i, _ in owners]
                )
                failed = next((o for o in outs if o.error is not None), None)
                if failed is not None:
                    raise RuntimeError(f"beam search step request {failed.request_id} failed: {failed.error}")
                for i, s in enumerate(searches):
                    if not s.done:
                        s.advance([o.outputs[0].logprobs[0] for (j, _), o in zip(owners, outs) if j == i])
                        if s.done and bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [s.result(engine.tokenizer) for s in searches]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings, as vLLM's `LLM.embed`: per prompt the final hidden state (after the model's
        final norm), pooled by the last token or the mean over all tokens (`pooling`; default: the
        engine's `pooling` option) and L2-normalised, in `out.outputs.embedding`. The prompts run
        through the engine as prefill-only requests (batched, chunked; no decode, no KV kept after).
        `truncate_prompt_tokens`: keep each prompt's last N tokens (-1: max_model_len)."""
        prompts = _as_list(prompts)
        params = self.engine.embedding_params(pooling)
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        results = self._run([(p, params, True, salt) for p, salt in map(_prompt_of, prompts)], use_tqdm)
        failed = next((r for r in results if r.error is not None or r.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"embedding request {failed.request_id} failed: {failed.error}")
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.embedding)) for r in results]

    def score(
        self,
        text_1: Prompt | Sequence[Prompt],
        text_2: Prompt | Sequence[Prompt],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Similarity scores, as vLLM's `LLM.score` for an embedding model: one text_1 against each
        text_2, or pairwise, each the cosine of the two texts' embeddings (`embed`, the engine's
        pooling; kvflow.entrypoints.scoring). One output per pair, in order."""
        first, second = (_as_list(t) for t in (text_1, text_2))
        pairs = pair_indices(len(first), len(second))
        embedded = self.embed(first + second, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        a, b = embedded[: len(first)], embedded[len(first) :]
        return [
            ScoringRequestOutput(
                f"score-{k}",
                ScoringOutput(cosine(a[i].outputs.embedding, b[j].outputs.embedding)),
                a[i].prompt_token_ids + b[j].prompt_token_ids,
            )
            for k, (i, j) in enumerate(pairs)
        ]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them through the model's chat template, as vLLM's
        `LLM.chat`: `sampling_params` and `lora_request` as `generate` takes them;
        `continue_final_message` ends the prompt inside the last (assistant) message, which the
        output continues (with add_generation_prompt=False); `tools` (JSON function schemas) are
        rendered by the template, their calls left in the text; `chat_template_kwargs`: more
        variables for the template (Qwen3's {"enable_thinking": False}); `chat_template`: a Jinja
        template to render with instead of the model's (or the `chat_template` engine option's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params, loras = _per_prompt(len(conversations), self._params_or_default(sampling_params), lora_request)
        prompts = [
            self.apply_chat_template(
                c, add_generation_prompt, chat_template_kwargs, continue_final_message, tools, chat_template
            )
            for c in conversations
        ]
        # The template already holds the special tokens (BOS etc.): do not add them twice.
        return self._run([(p, sp, False, None) for p, sp in zip(prompts, params)], use_tqdm, loras)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        tok = self.engine.tokenizer
        if tok is None or (chat_template is None and not getattr(tok, "chat_template", None)):
            raise ValueError(
                "this model has no chat template; use generate() with a plain prompt, or give chat_template"
            )
        check_continuation(
            add_generation_prompt, continue_final_message, messages[-1].get("role") if messages else None
        )
        return tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **({"continue_final_message": True} if continue_final_message else {}),
            **({"tools": tools} if tools else {}),
            **({"chat_template": chat_template} if chat_template is not None else {}),
            **template_kwargs(chat_template_kwargs),
        )

    def _run(
        self,
        items: list[tuple[str | list[int], SamplingParams, bool, str | None]],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run (prompt, params, add_special_tokens, cache_salt) items to the end, in order."""
        engine = self.engine
        ids: list[str] = []
        try:
            for i, (prompt, params, special, salt) in enumerate(items):
                lora = None if loras is None else loras[i]
                ids.append(
                    engine.add_request(
                        None, prompt, params, add_special_tokens=special, lora_request=lora, cache_salt=salt
                    )
                )
        except Exception:
            engine.abort(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def _params_or_default(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> SamplingParams | Sequence[SamplingParams]:
        return self.get_default_sampling_params() if sampling_params is None else sampling_params

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams, as vLLM's: the API's
        defaults with the model's generation_config.json recommendations (--generation-config)."""
        return self.engine.default_sampling_params()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Release the engine: persist the prefix cache to the KV offload tiers (if configured), stop
        the KV connector and the worker processes, and leave the process group. Idempotent."""
        self._finalizer()


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, token ids, a prompt dict) as a list of one; a list of them as is."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(
    n: int,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
) -> tuple[list[SamplingParams], list[LoRARequest | None]]:
    """One SamplingParams and one adapter (or None) per prompt: a single one for all, or a list."""
    params = sampling_params if sampling_params is not None else SamplingParams()
    params = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(params) != n:
        raise ValueError(f"got {n} prompts but {len(params)} SamplingParams")
    loras = [lora_request] * n if not isinstance(lora_request, (list, tuple)) else list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {n} prompts but {len(loras)} lora_requests")
    return params, loras
