"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import EngineStats, LLMEngine
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        return self._run([(p, sp, True) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params or SamplingParams()
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        # The template already holds the special tokens (BOS etc.): do not add them twice.
        return self._run([(p, params, False) for p in prompts], use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _run(self, items: list[tuple[Prompt, SamplingParams, bool]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, params, special in items:
                ids.append(engine.add_request(None, prompt, params, add_special_tokens=special))
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

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Persist the prefix cache to the KV offload tiers, if any are configured."""
        self.engine.shutdown()
