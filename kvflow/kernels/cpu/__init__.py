"""Native CPU kernels: the C/C++ sources (csrc/) and their ctypes bindings.

* `native`          -- compiles csrc/ into shared libraries at first use (cached) and loads them;
  the call shared by the native linears (`call_linear`, `fused_linear`).
* `paged_attention` -- csrc/paged_attention.cpp: paged attention over query rows read from the
  cache in place, the cache write and the native rotary (`rotary_`); the backend built on it is
  kvflow.attention.backends.cpu.
* `int8_linear`     -- csrc/int8_linear.cpp: `Int8Kernel`, the W8A8 linear through FBGEMM.
* `float_linear`    -- csrc/float_linear.cpp: `NativeFloatKernel`, the fp32 / bf16 register-tiled GEMM.
* `block_linear`    -- csrc/block_linear.cpp: `BlockQuantKernel`, the linear over GGUF's block formats;
  `GroupedInputKernel` around it for quantized HF checkpoints (act-order gather, group offsets).
* `decode_pass`     -- csrc/decode_pass.cpp: `DecodePassKernel`, a decode-only step's layers in one
  call, int8, fp32 / bf16 or GGUF blocks (built for a model by kvflow.models.decode_pass).
* `allocator`       -- glibc malloc settings that keep freed memory for the next step.
"""
