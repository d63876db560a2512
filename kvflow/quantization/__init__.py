"""Quantization formats, as torch (and numpy) code: no kernels, layers or models here.

* `int8`        -- symmetric int8 with one scale per row or per vector: the int8 linear backends'
  weights and the int8 KV cache (`quantize_kv`).
* `smoothquant` -- SmoothQuant-style scales moving activation outliers into the weights before
  int8 quantization, and the fixed text they are calibrated on.
* `gguf_blocks` -- GGUF's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): `BlockQuantized` weights
  kept as a file stores them, their float32 dequantization, and round-to-nearest quantization into
  Q4_0 / Q4_1 / Q8_0 (``--quantization int4``).
* `checkpoint_formats` -- a HF checkpoint's `quantization_config` (GPTQ, AWQ, compressed-tensors)
  parsed and validated: what runs as stored, and a clear error for the rest.
* `packed_weights` -- those checkpoints' packed tensors unpacked to integer codes and placed into
  the kernels' formats (GGUF blocks, group offsets, act-order permutations, int8 rows).

The kernels that compute with these formats are in kvflow.kernels (cpu/int8_linear.py,
cpu/block_linear.py, int_mm.py).
"""
