"""The quantized KV cache formats (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2 | int4`): how a
token's keys and values are stored, quantized at cache-write time and dequantized when read.

Every format keeps one float32 scale per token, per K/V, per kv head, computed from the vector
itself as it is written (amax / the format's largest magnitude), so nothing is calibrated and an
outlier token cannot spoil its neighbours. The codes are:

- int8: round(x / scale), scale = amax / 127 (symmetric).
- fp8_e4m3: x / scale cast to torch.float8_e4m3fn (round to nearest even), scale = amax / 448.
- fp8_e5m2: x / scale cast to torch.float8_e5m2, scale = amax / 57344.
- int4: round(x / scale) in [-7, 7], scale = amax / 7 (symmetric, no zero point), stored as q + 8
  in a nibble, two values a byte: element 2i in the low nibble of byte i, 2i + 1 in the high one.
  `data` is then uint8 [..., head_dim / 2] (head_dim must be even).

Scaling an fp8 vector by its amax puts its largest element at the format's maximum, so the codes use
the format's whole range; the error is then the format's relative rounding (2^-4 for e4m3, 2^-3 for
e5m2) down to the subnormals. The CPU kernels (kvflow/kernels/cpu/csrc/attention.h) write and read
the same codes; the Triton kernels decode them from their bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.config import FLOAT_KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES

MIN_KV_SCALE = 1e-12  # as kvflow.quantization.int8: an all-zero vector quantizes to zeros


@dataclass(frozen=True)
class KVFormat:
    """One quantized KV cache dtype."""

    name: str  # the --kv-cache-dtype value
    storage: torch.dtype  # LayerKVCache.data's element type
    values_per_element: int  # values packed in one stored element (int4: 2 a byte)
    qmax: float  # the largest code magnitude: scale = amax / qmax
    what: str  # one value's cost, as the start-up log says it

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) of one kv head: the codes and their float32 scale."""
        return head_dim // self.values_per_element + 4


KV_FORMATS = {
    "int8": KVFormat("int8", torch.int8, 1, 127.0, "1 byte + a 4-byte scale per head"),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 1, 448.0, "1 byte (fp8 e4m3) + a 4-byte scale per head"),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 1, 57344.0, "1 byte (fp8 e5m2) + a 4-byte scale per head"),
    "int4": KVFormat("int4", torch.uint8, 2, 7.0, "half a byte + a 4-byte scale per head"),
}
assert tuple(KV_FORMATS) == QUANTIZED_KV_CACHE_DTYPES

_BY_STORAGE = {f.storage: f for f in KV_FORMATS.values()}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The format of a quantized KV dtype; None for the float ones ("auto": the model's dtype)."""
    if kv_cache_dtype == "auto" or kv_cache_dtype in FLOAT_KV_CACHE_DTYPES:
        return None
    if kv_cache_dtype not in KV_FORMATS:
        names = ", ".join(("auto", *FLOAT_KV_CACHE_DTYPES, *KV_FORMATS))
        raise ValueError(f"kv_cache_dtype must be one of {names}, got {kv_cache_dtype!r}")
    return KV_FORMATS[kv_cache_dtype]


def kv_float_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a float KV cache: the named one, or the model's for "auto". (A float32
    model's K/V can be kept in bfloat16: half the bytes, each value rounded once as it is written;
    attention reads them widened to float32; the native CPU prefill tiles multiply them in bf16 where
    the CPU has AVX512_BF16, kvflow/kernels/cpu/csrc/tiled_attention.h.)"""
    return getattr(torch, kv_cache_dtype) if kv_cache_dtype in FLOAT_KV_CACHE_DTYPES else model_dtype


def format_of(data: torch.Tensor) -> KVFormat:
    """The format of a quantized cache from its stored element type."""
    return _BY_STORAGE[data.dtype]


def check_head_dim(fmt: KVFormat | None, head_dim: int) -> None:
    if fmt is not None and fmt.values_per_element == 2 and head_dim % 2:
        raise ValueError(f"kv_cache_dtype='int4' packs two values a byte: head_dim must be even, got {head_dim}")


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (codes [..., head_dim / values_per_element] of
    fmt.storage, scale [...] float32), one scale per vector."""
    x = x.float()
    scale = x.abs().amax(-1).mul_(1 / fmt.qmax).clamp_min_(MIN_KV_SCALE)
    y = x / scale.unsqueeze(-1)
    if fmt.name == "int4":
        q = torch.round(y).clamp_(-7, 7).to(torch.int16) + 8  # 1 .. 15
        return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8), scale
    if fmt.name == "int8":
        return torch.round(y).to(torch.int8), scale
    # |y| <= qmax up to the division's rounding: clamped, as a value past the max would become NaN.
    return y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., head_dim / values_per_element] and their scales [...] -> values [..., head_dim]
    in `dtype` (code times scale, rounded once to `dtype`)."""
    fmt = format_of(data)
    if fmt.name == "int4":
        lo = (data & 0xF).to(torch.int8) - 8
        hi = (data >> 4).to(torch.int8) - 8
        codes = torch.stack((lo, hi), dim=-1).flatten(-2)
    else:
        codes = data
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)
