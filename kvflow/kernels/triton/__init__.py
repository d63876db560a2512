"""GPU kernels in Triton (CUDA devices; on the CPU under TRITON_INTERPRET=1, for tests).

* `attention_kernels` -- paged decode (GQA: a kv head read once for its query heads) and paged
  prefill / chunk attention (FlashAttention-style tiles, online softmax), quantized KV (int8,
  fp8, int4) dequantized as it is loaded. The backend built on them is kvflow.attention.backends.triton.
"""
