"""The models' building blocks, as torch modules and the kernel choices behind them. Not
device-neutral: the linear backends are mostly the CPU's (native GEMV, oneDNN, FBGEMM int8, GGUF
blocks), with `F.linear` and `torch._int_mm` for other devices.

* `linear`         -- `Linear`, a projection that runs the kernel `prepare` chose for it.
* `linear_kernels` -- which kernel runs a linear: the backends, the float paths and their choice
  per shape and row count (`KernelPlan`, measured by kvflow.worker.autotune).
* `moe`            -- the Mixture-of-Experts feed-forward: router, experts grouped by expert,
  shared expert (`SparseMoeBlock`).
* `norm`           -- `RMSNorm`.
* `rotary`         -- rotary position embeddings, in torch or the CPU's native kernel.

Attention is kvflow.attention; the quantization formats are kvflow.quantization.
"""
