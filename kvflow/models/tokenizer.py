"""A fast tokenizer that does not import transformers.

Importing transformers costs ~1 s, a large share of a warm `kvflow serve` start. `FastTokenizer`
serves what the engine and the server call (encode, decode, special tokens, the chat template) from
a `tokenizers.Tokenizer` and a few attributes taken from a transformers tokenizer once
(`state_of`), so both give the same ids, text and prompts: the backend is transformers' own after
its constructor ran (added special tokens, post-processor), serialized. The GGUF loader keeps that
state in its cache (`gguf_cache.py`), so later starts never build the HF tokenizer.

Anything else (batch padding, tensors, `continue_final_message`, ...) goes to the equivalent
transformers tokenizer, built on first such use (`to_hf`).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from kvflow.models import chat_template

# Attributes copied from the transformers tokenizer: plain JSON values.
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
_STATE_ATTRS = (
    *_SPECIAL,
    "add_bos_token",
    "add_eos_token",
    "chat_template",
    "special_tokens_map",
    "all_special_tokens",
    "clean_up_tokenization_spaces",
    "split_special_tokens",
)
_STATE_VERSION = 1


def state_of(hf_tokenizer: Any) -> dict[str, Any]:
    """What `FastTokenizer` needs from a transformers fast tokenizer (JSON-serializable)."""
    state = {name: getattr(hf_tokenizer, name, None) for name in _STATE_ATTRS}
    state["special_tokens_map"] = dict(state["special_tokens_map"] or {})
    state["all_special_tokens"] = list(state["all_special_tokens"] or [])
    state["backend"] = hf_tokenizer.backend_tokenizer.to_str()
    state["version"] = _STATE_VERSION
    return state


class FastTokenizer:
    """The subset of `PreTrainedTokenizerFast` kvflow uses, with the same results (tests hold it to
    transformers); `from_state(state_of(hf))`."""

    def __init__(self, backend: Any, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"tokenizer state version {state.get('version')!r}, expected {_STATE_VERSION}")
        if state.get("clean_up_tokenization_spaces") or state.get("split_special_tokens"):
            # Neither is set by any tokenizer we build; both change encode/decode in transformers.
            raise ValueError("FastTokenizer does not implement clean_up_tokenization_spaces / split_special_tokens")
        self._backend = backend
        self._state = state
        for name in (*_SPECIAL, "add_bos_token", "add_eos_token"):
            setattr(self, name, state[name])
        self.special_tokens_map: dict[str, Any] = dict(state["special_tokens_map"])
        self.all_special_tokens: list[str] = list(state["all_special_tokens"])
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> FastTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(state["backend"]), state)

    @property
    def state(self) -> dict[str, Any]:
        return self._state

    @property
    def chat_template(self) -> Any:
        return self._state["chat_template"]

    @chat_template.setter
    def chat_template(self, value: Any) -> None:
        # (kept in the state, so a copy -- the server's, a worker's -- renders with it too)
        self._state = {**self._state, "chat_template": value}
        with self._hf_lock:
            self._hf = None

    # ---- ids ---------------------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self._backend.get_added_tokens_decoder().items()))

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._backend.token_to_id(token)
        return self._backend.token_to_id(self.unk_token) if i is None and self.unk_token is not None else i

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str] | None:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def all_special_ids(self) -> list[int]:
        return [self._token_id(t) for t in self.all_special_tokens]

    # ---- text --------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self.to_hf().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        if kwargs:
            return self.to_hf()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            enc = self._backend.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": enc.ids, "attention_mask": enc.attention_mask}
        encs = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs]}

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.to_hf().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        # The form kvflow uses (one conversation to text, JSON tools, extra template variables)
        # renders here; the others (token ids -- a BatchEncoding there --, documents,
        # continue_final_message, batches, callables as tools, ...) in transformers.
        if (
            tokenize
            or not chat_template.renders_here(conversation, tools, kwargs)
            or not self.chat_template
            or isinstance(self.chat_template, dict)
        ):
            return self.to_hf().apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        return chat_template.render(
            self.chat_template, conversation, tools, add_generation_prompt, {**self.special_tokens_map, **kwargs}
        )

    # ---- the rest: transformers ----------------------------------------------------------------------
    def to_hf(self) -> Any:
        """The equivalent transformers tokenizer (imports transformers; built once)."""
        with self._hf_lock:
            if self._hf is None:
                from tokenizers import Tokenizer
                from transformers import PreTrainedTokenizerFast

                kwargs = {name: self._state[name] for name in (*_SPECIAL, "add_bos_token", "add_eos_token")}
                if self.chat_template:
                    kwargs["chat_template"] = self.chat_template
                self._hf = PreTrainedTokenizerFast(
                    tokenizer_object=Tokenizer.from_str(self._state["backend"]), **kwargs
                )
            return self._hf

    def __deepcopy__(self, memo: dict[int, Any]) -> FastTokenizer:
        # The backend is never reconfigured here (no truncation/padding setters, the only calls that
        # borrow it mutably), so copies (one per thread) can share it; the HF twin is per copy.
        return FastTokenizer(self._backend, copy.deepcopy(self._state, memo))

    def __repr__(self) -> str:
        return f"FastTokenizer(vocab={len(self)}, bos={self.bos_token!r}, eos={self.eos_token!r})"
