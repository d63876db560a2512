"""Rotary position embeddings (the rotate-half layout HF checkpoints use)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvflow.config import RopeConfig
from kvflow.kernels.cpu import paged_attention as cpu_kernels

# Rotary in place on x [T, heads, head_dim]: f(x, cos, sin_signed), cos and sin_signed as
# `RotaryEmbedding.lookup` returns them.
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def _base_exponents(head_dim: int) -> torch.Tensor:
    """2i / head_dim for i < head_dim / 2, in float32 (HF's `arange(0, dim, 2) / dim`)."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def inverse_frequencies(head_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] (float32) of `rope`; for ``longrope``, those of
    its short factors, or with `long` its long ones (see `rope_tables` for which are used)."""
    if rope.scaling_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta ** _base_exponents(head_dim))
    if rope.scaling_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope)
    base = rope.theta
    if rope.scaling_type == "dynamic":
        # Dynamic NTK at the model's own context length (HF's frequencies until a sequence grows past
        # max_position_embeddings, which kvflow's max_model_len never does): base * 1 ** (...).
        max_pos = rope.max_position_embeddings
        base = base * ((rope.factor * max_pos / max_pos) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** _base_exponents(head_dim))
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth blend between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def _yarn_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: per dimension, a blend of the interpolated (slowed by `factor`) and the extrapolated
    (unchanged) frequency, by a linear ramp between the dimensions that turn beta_fast and beta_slow
    times over the original context (HF's `_compute_yarn_parameters`, op for op)."""
    dim, base, old_len = head_dim, rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (HF's guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN and LongRoPE scale cos and sin by (1.0 for the other types), as HF derives it
    when the config does not give `attention_factor`."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.scaling_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
        return mscale(rope.factor)
    if rope.scaling_type == "longrope" and rope.factor > 1.0:
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def rope_tables(head_dim: int, max_positions: int, rope: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, row p for position p (HF's rotary forward:
    freqs = p * inv_freq, emb = cat(freqs, freqs), cos / sin times the attention factor), for a
    model serving contexts of up to `max_positions` tokens.

    LongRoPE: HF transformers rotates a sequence with the long factors once it is longer than
    `original_max_position_embeddings`, every position of it: its forward pass picks the factors by
    the sequence's length, and Phi-3's generate drops the KV cache and recomputes the whole sequence
    with the long ones when it grows past that length. kvflow picks once, by the context it serves:
    the long factors when `max_positions` (max_model_len) is past the original context, else the
    short ones -- HF's choice for every sequence that starts past the original context, and for
    every sequence when the context stays within it (docs/models.md).

    Partial rotary (`rope.partial_rotary_factor` < 1): the rotated features sit where
    `partial_rotary_order` puts them, each half's first rotary_dim / 2 places; the others take
    cos 1 and sin 0, so every rotary path (torch, native, the decode pass) leaves them as they are."""
    long = rope.scaling_type == "longrope" and max_positions > rope.original_max_position_embeddings
    rotary = rope.rotary_dim(head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(rotary, rope, long=long))
    scale = attention_factor(rope)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    still = (max_positions, (head_dim - rotary) // 2)  # (the unrotated places of each half)
    cos = torch.cat((cos, torch.ones(still)), dim=-1)
    sin = torch.cat((sin, torch.zeros(still)), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Where a head's features go for rotate-half over the whole head to rotate only its first
    `rotary_dim` as HF does (pairs (i, i + rotary_dim / 2); `interleaved`, GLM's: pairs (2i, 2i + 1)):
    new feature j is old feature order[j]. Each pair's two features move to places j and
    j + head_dim / 2 (j < rotary_dim / 2, the pair's frequency), the unrotated features fill the
    rest. Applied to the rows of q_proj and k_proj (and anything per feature of q and k) at load:
    q . k is the same sum over the features in another order, and v, hence the attention's output,
    is untouched."""
    half, still = rotary_dim // 2, (head_dim - rotary_dim) // 2
    r, p = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    first, second = (r[0::2], r[1::2]) if interleaved else (r[:half], r[half:])
    return torch.cat((first, p[:still], second, p[still:]))


def to_partial_rotary_rows(
    rows: torch.Tensor, head_dim: int, rotary_dim: int, interleaved: bool = False
) -> torch.Tensor:
    """The rows (dim 0: heads x head_dim, e.g. a q or k projection's weight or bias) with each
    head's features in `partial_rotary_order`."""
    if rotary_dim == head_dim and not interleaved:
        return rows
    order = partial_rotary_order(head_dim, rotary_dim, interleaved)
    heads = rows.shape[0] // head_dim
    index = (torch.arange(heads).unsqueeze(1) * head_dim + order).reshape(-1)
    return rows.index_select(0, index)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position up to max_positions; looked up once per step."""

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        cos, sin = rope_tables(head_dim, max_positions, rope)
        # (YaRN / LongRoPE: cos and sin carry this factor; a rotation by a position delta built from
        # the tables must divide it out)
        self.attention_factor = attention_factor(rope)
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == x.roll(half) * sin_signed.
        half = head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(head_dim - half)))
        self.register_buffer("sin_signed", (sin * sign).to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed of shape [T, 1, head_dim], for `apply_rotary_`."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin_signed.index_select(0, positions).unsqueeze(1)


def apply_rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim] in three ops, written into `out` (default: x itself).

    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == x.roll(half, -1) * sin_signed (the
    same products, sign included); `out` may alias x: both products are taken before it is written.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, sin_signed, out=x if out is None else out)


def select_rotary(device: torch.device, dtype: torch.dtype, head_dim: int, native: bool) -> RotaryFn:
    """The in-place rotary to run on x [T, heads, head_dim] (heads contiguous, any row stride).

    `native`: the CPU's native kernel (kvflow.kernels.cpu.paged_attention.rotary_, the code the native
    decode pass runs, so a token's keys do not depend on which path computed them) where it can run
    for this device, dtype and head_dim. Otherwise, or with `native` False: `apply_rotary_`."""
    if native and device.type == "cpu" and cpu_kernels.rotary_available(dtype, head_dim):
        return cpu_kernels.rotary_
    return apply_rotary_
