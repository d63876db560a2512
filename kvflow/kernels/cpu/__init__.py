"""Native CPU kernels: the C/C++ sources (csrc/) and their ctypes bindings.

* `native`          -- compiles csrc/ into shared libraries at first use (cached) and loads them.
* `paged_attention` -- csrc/paged_attention.cpp: `CpuPagedAttention` (decodes read from the paged
  cache in place), the cache write and the native rotary (`rotary_`).
* `int8_linear`     -- csrc/int8_linear.cpp: `Int8Kernel`, the W8A8 linear through FBGEMM.
* `float_linear`    -- csrc/float_linear.cpp: `NativeFloatKernel`, the fp32 / bf16 register-tiled GEMM.
* `decode_pass`     -- csrc/decode_pass.cpp: `NativeDecode`, a decode-only step's layers in one call,
  int8, fp32 / bf16 or GGUF blocks (handed to the model by `CpuPagedAttention.decode_pass`).
* `autotune`        -- which fp32 / bf16 path runs each projection shape at each row count, and the
  decode pass's row limit, measured at the first start on a CPU and cached (`KernelPlan`).
"""
