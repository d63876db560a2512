"""Which layers share KV block tables, and what a block costs: the hybrid KV layout.

A sliding-window layer only ever reads the last `window` keys, so its KV past that is dead weight.
Gemma 3 (five local layers to one global) keeps most of its KV in such layers; Mistral keeps all of
it there. The layout says how the KV cache manager and the model runner split the layers:

- Layers are bucketed by their window (None: full attention). With one bucket (a model without
  windows, or Mistral, where every layer has the same window) there is one group of all layers,
  as without this module: a Mistral request's blocks are simply freed as they leave the window.
- With several buckets (Gemma 2/3), each bucket is cut into groups of `slots` layers, `slots`
  being (about) the smallest bucket's size, as vLLM's hybrid allocator does (`_page_layers`).
  Every group has its own block table per request, and all groups draw their blocks from ONE pool of equal pages: a
  page is one block of `slots` layers. The runner allocates `slots` KV tensors and the j-th layer
  of every group uses tensor j, so a block id means different memory for no two groups at once.
  One pool (rather than a pool per window sized by a ratio) keeps short requests as cheap as
  without windows: a request shorter than the window needs as many pages in every group either
  way, and a fixed ratio would starve one side whenever the workload's lengths moved.
  A bucket whose size is not a multiple of `slots` has a last, shorter group: its unused tensor
  slots are wasted bytes, counted in the capacity the start-up log reports.
- A window group keeps, per request, only the blocks that the next query can still read: query
  position p reads keys [p - window + 1, p], so when a step starts at position `start` every block
  wholly before `start - window + 1` is released (to the prefix cache, as cached-free) and its
  table entry points at NULL_BLOCK, reserved in the pool, which the window masks (it only ever
  holds zeros or a start-up probe's finite scratch values). Chunked prefill is covered: the
  step's first query is the one reaching furthest back, and speculative decoding too: rejected
  drafts never move a request's computed length back.
- A window of max_model_len tokens or more frees nothing: such layers count as full attention.

`disable_hybrid_kv_cache_manager` (vLLM's name) turns the saving off: one group of all layers that
keeps every block, as before. Limits (`refusal`, checked at start-up): the KV connectors (offload
tiers, disaggregation) move whole blocks of every layer, so they need the saving off whenever a
group frees blocks; tensor parallelism sends one block table per sequence, so it needs one group.
With several groups the runner skips the fused decode pass and CUDA graphs (they read one table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.config import ModelConfig

NULL_BLOCK = 0  # with a window group: reserved, never allocated; freed table entries point here


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention, keeps every block
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_layers: int
    slots: int  # layers per page: the KV tensors the runner allocates

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Some group drops blocks that left its window (and the pool reserves NULL_BLOCK)."""
        return any(g.window is not None for g in self.groups)

    def slot_of(self, layer: int) -> tuple[int, int]:
        """(group, tensor slot) of decoder layer `layer`."""
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group (the model has {self.num_layers} layers)")

    def first_needed_block(self, group: int, first_query: int, block_size: int) -> int:
        """The first block of `group` that a query at position `first_query` (or later) can read."""
        w = self.groups[group].window
        return 0 if w is None else max(0, first_query - w + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pages one request of num_tokens tokens holds at most, computed `chunk` tokens a step."""
        total = cdiv(num_tokens, block_size)
        held = 0
        for gi, g in enumerate(self.groups):
            if g.window is None:
                held += total
            else:
                # the step that ends at num_tokens starts at num_tokens - chunk
                first = self.first_needed_block(gi, max(0, num_tokens - chunk), block_size)
                held += total - first
        return held

    def describe(self) -> str:
        parts = []
        for w in dict.fromkeys(g.window for g in self.groups):
            gs = [g for g in self.groups if g.window == w]
            n = sum(len(g.layers) for g in gs)
            parts.append(f"{n} {'full-attention' if w is None else f'window-{w}'} layers in {len(gs)} group(s)")
        return "; ".join(parts)


def single_group(num_layers: int, window: int | None = None) -> KVLayout:
    return KVLayout((KVGroup(window, tuple(range(num_layers))),), num_layers, num_layers)


def _page_layers(bucket_sizes: list[int], num_layers: int) -> int:
    """Layers per page: the largest divisor of the smallest bucket whose padding (a bucket's last,
    shorter group still takes whole pages) stays within an eighth of the layers. Fewer, larger
    groups mean fewer block tables and attention metadata per step; Gemma 3 1B (22 local, 4 global
    layers) gets 4 (2 slots of padding), Gemma 2 (13 and 13) 13, a 5:1 model of 6 layers 1."""
    smallest = min(bucket_sizes)
    for d in range(smallest, 0, -1):
        if smallest % d == 0 and sum(cdiv(b, d) * d for b in bucket_sizes) - num_layers <= num_layers / 8:
            return d
    return 1


def kv_layout(model_config: ModelConfig, disable_hybrid: bool = False, max_model_len: int | None = None) -> KVLayout:
    """The layout for this model (see the module docstring). A window of max_model_len tokens or
    more frees nothing: its layers count as full attention here (one group, one block table:
    no extra metadata per step, and the fused decode paths stay available)."""
    n = model_config.num_layers
    windows = [model_config.window_of(i) for i in range(n)]
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    if disable_hybrid:
        return single_group(n)
    buckets: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        buckets.setdefault(w, []).append(i)
    if len(buckets) == 1:
        return single_group(n, windows[0])
    slots = _page_layers([len(v) for v in buckets.values()], n)
    groups = []
    # full attention first: group 0's table is the one the prefix cache's events and the KV
    # connectors speak of
    for w in sorted(buckets, key=lambda w: (w is not None, w or 0)):
        layers = buckets[w]
        for k in range(0, len(layers), slots):
            groups.append(KVGroup(w, tuple(layers[k : k + slots])))
    return KVLayout(tuple(groups), n, slots)


def requests_that_fit(layout: KVLayout, num_pages: int, num_tokens: int, block_size: int, chunk: int) -> int:
    """How many requests of num_tokens tokens (computed `chunk` tokens a step) fit in num_pages
    usable pages at once, each at its largest (the step that reaches num_tokens)."""
    return num_pages // layout.blocks_held(num_tokens, block_size, chunk)


def refusal(layout: KVLayout, config) -> str | None:
    """Why this engine config cannot run with this layout (None: it can). Checked at start-up,
    before anything is allocated: a wrong block layout would corrupt KV silently."""
    fix = "; pass --disable-hybrid-kv-cache-manager to keep every block of every layer"
    if layout.frees_blocks and (
        config.kv_transfer_config is not None or config.kv_offload_cpu_gb > 0 or config.kv_offload_disk_dir
    ):
        return (
            "the KV connectors (kv_transfer_config, the kv_offload tiers) move whole blocks of every layer, "
            "but sliding-window layers hold only their window's blocks here" + fix
        )
    if layout.num_groups > 1 and config.tensor_parallel_size > 1:
        return (
            f"tensor_parallel_size={config.tensor_parallel_size} with sliding-window and full-attention layers "
            f"({layout.describe()}): the worker processes take one block table per sequence so far" + fix
        )
    return None
