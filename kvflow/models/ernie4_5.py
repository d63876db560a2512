"""ERNIE 4.5 dense (HF `Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): the Llama decoder whose rotary
turns interleaved pairs of each head's features (2i and 2i + 1 at frequency i, over the whole
head; HF transformers' modeling_ernie4_5.py). Its q and k rows are reordered per head at load
(kvflow.models.qk_layout), so every Llama path -- the native decode pass included -- runs it as
it is."""

from __future__ import annotations

from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.qk_layout import InterleavedRotaryRows


class Ernie4_5ForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    """The Llama decoder, its q/k rows in the interleaved rotary's order (see the top of the file)."""
