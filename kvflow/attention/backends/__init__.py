"""The attention backends, one module each; kvflow.attention.selector chooses among them.

* `torch`  -- `TorchPagedAttention`, the portable reference (any device): gathers each sequence's
  keys and values and runs `scaled_dot_product_attention` on padded groups.
* `cpu`    -- `CpuPagedAttention`: every query row (decodes and prefill chunks, float32 or
  bfloat16 models) read from the paged cache in place by the native kernel in
  kvflow/kernels/cpu/csrc/paged_attention.cpp.
* `triton` -- `TritonPagedAttention`: the Triton kernels of kvflow.kernels.triton (CUDA devices),
  with the static metadata buffers CUDA graphs of decode steps replay from.
"""
