"""Kernels: bindings and native sources, one package per kind of device -- `cpu/` (C/C++ sources
compiled at first use, called through ctypes) and `triton/` (Triton programs, CUDA devices) --
and the torch forms they share (`norm`: RMSNorm as plain tensors; `int_mm`: W8A8 through
`torch._int_mm`). They take tensors and plain values, never layers or models: the attention
backends (kvflow.attention.backends) and the linear layers (kvflow.layers.linear_kernels) are
built on them, and the quantization formats they compute with are kvflow.quantization's."""
