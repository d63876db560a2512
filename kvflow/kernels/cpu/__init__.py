"""Native CPU kernels: the C/C++ sources (csrc/) and their ctypes bindings.

* `native`          -- compiles csrc/ into shared libraries at first use (cached) and loads them.
* `paged_attention` -- csrc/paged_attention.c: `CpuPagedAttention` (decodes read from the paged
  cache in place), the cache write and the native rotary (`rotary_`).
* `int8_linear`     -- csrc/int8_linear.cpp: `Int8Kernel`, the W8A8 linear through FBGEMM.
* `int8_decode`     -- csrc/int8_decode.cpp: `NativeDecode`, an int8 model's decode-only step in one
  call (handed to the model by `CpuPagedAttention.decode_pass`).
"""
