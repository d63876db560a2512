"""Attention over the paged KV cache.

* `backend`  -- the device-neutral part: the KV cache of a layer (`LayerKVCache`), a step's layout
  (`SeqLayout`, `TokenLayout`) and metadata (`AttentionMetadata` of `AttentionGroup`s and
  `PagedRows`), and the interface every backend implements (`AttentionBackend`). Torch only.
* `backends/` -- the implementations: `torch` (the portable reference), `cpu` (the native kernel),
  `triton` (CUDA). Their kernels (ctypes bindings, C++ sources, Triton programs) are in
  kvflow.kernels.
* `selector` -- `make_attention_backend`, the one place that chooses among them.
"""
