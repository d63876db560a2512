"""Device-specific kernels, one package per kind of device: `cpu/` (C/C++ sources compiled at first
use, called through ctypes) and `triton/` (GPU kernels in Triton). The layers (kvflow.layers) reach them only through these packages."""
