"""Quantized checkpoint tensors (GPTQ, AWQ, compressed-tensors) unpacked to integer codes, and
placed into the formats kvflow's kernels run: GGUF blocks (Q4_0, Q4_1, Q8_0) for weight-only
formats, per-channel int8 (`Int8Rows`) for W8A8. Nothing here goes through float weights.

Every weight-only format here is, per output channel o and input i,
    w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]
with unsigned codes q of `bits` bits, a zero point z and a scale s per group g(i) (i // group_size,
or `g_idx[i]` for GPTQ's act-order). The blocks hold 32 inputs with one scale each:
* z == 2^(bits-1) everywhere (symmetric): Q4_0 (d = s: w = d * (q - 8)) or Q8_0 (d = s, q - 128
  as int8) -- exact when s is an fp16 number (GPTQ and AWQ store fp16 scales; bf16 scales within
  fp16's normal range are too);
* otherwise (4 bits), groups of 32: Q4_1, w = d * q + m with d = s and m = fp16(-z * s): the one
  rounding added, |m - (-z * s)| <= 2^-11 * |z * s| <= 2^-11 * 16 * s per weight (half an ulp of an
  fp16 with 10 mantissa bits; z <= 16 counting GPTQ v1's wrapped zero);
* otherwise (4 bits), wider groups: w = s * (q - 8) + s * (8 - z): Q4_0 blocks of the first term
  and a float32 offset s * (8 - z) per (channel, group), exact, added by the kernel as
  offsets . (the inputs summed per group) (GroupedInputKernel).
Groups wider than 32 repeat their scale in every block: Q4_0 holds 4.5 bits a weight, plus 32 /
group for the offsets (GPTQ/AWQ group 128 store ~4.16 bits with zeros, 4.125 without: held / packed
1.09 symmetric, 1.14 asymmetric); Q4_1 for groups of 32 holds 5 bits where the file has 4.625 (1.08).

Act-order (`g_idx`): the input columns are permuted at load so each group's columns are
contiguous (a stable sort by group), and the kernel gathers the activation columns the same way
at run time (`perm`), which is exact: W x = W[:, p] x[p].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.quantization.gguf_blocks import FORMATS, BlockQuantized

# AWQ's GEMM packing puts output column order[j] of each 8 in nibble j (AutoAWQ's pack order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class IntGroups:
    """Unpacked weight-only codes: `codes` uint8 [out, in] (unsigned, 0 .. 2^bits - 1), `scale`
    float32 [out, groups], `zero` int32 [out, groups], `g_idx` int64 [in] (each input's group)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float64 [out, in] (the reference value the formats define)."""
        s = self.scale.double()[:, self.g_idx]
        z = self.zero.double()[:, self.g_idx]
        return (self.codes.double() - z) * s


@dataclass
class Int8Rows:
    """Per-channel symmetric int8 weights (W8A8's): `q` int8 [out, in], `scale` float32 [out]."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @staticmethod
    def cat(parts: list[Int8Rows]) -> Int8Rows:
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def scaled(self, factor: float) -> Int8Rows:
        return Int8Rows(self.q, self.scale * factor)


@dataclass
class Fp8Rows:
    """float8 e4m3 weights as an FP8 checkpoint stores them: `q` torch.float8_e4m3fn [out, in],
    `scale` float32 [out] (a per-tensor scale repeated), `activations` "none" or "fp8-token"."""

    q: torch.Tensor
    scale: torch.Tensor
    activations: str = "none"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @staticmethod
    def cat(parts: list[Fp8Rows]) -> Fp8Rows:
        return Fp8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), parts[0].activations)

    def scaled(self, factor: float) -> Fp8Rows:
        return Fp8Rows(self.q, self.scale * factor, self.activations)


@dataclass
class GroupedBlocks:
    """Blocks with what they cannot hold of a group-wise format (see GroupedInputKernel):
    `perm` -- inputs permuted (act-order), y = W' x[perm]; `offsets` -- float32 [out, groups], the
    per-group term of an asymmetric format, y += offsets . (x summed over each `group` inputs).
    `parts` are consecutive runs of output channels (a fused projection's)."""

    parts: list[BlockQuantized]
    perm: torch.Tensor | None = None  # int64 [in]
    offsets: torch.Tensor | None = None  # float32 [out, in / group]
    group: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def scaled(self, factor: float) -> GroupedBlocks:
        offsets = None if self.offsets is None else self.offsets * factor
        return GroupedBlocks([p.scaled(factor) for p in self.parts], self.perm, offsets, self.group)


STORED_TYPES = (Int8Rows, GroupedBlocks, Fp8Rows)  # (each has `scaled(factor)`: the weight times factor)


def fuse_stored(name: str, parts: list) -> list[BlockQuantized] | Int8Rows | GroupedBlocks | Fp8Rows:
    """One fused projection (`name`: q|k|v or gate|up) from its parts as a quantized checkpoint
    stores them; they must share one kind (and one act-order permutation, one group size)."""
    if all(isinstance(p, Int8Rows) for p in parts):
        return Int8Rows.cat(parts)
    if all(isinstance(p, Fp8Rows) for p in parts):
        return Fp8Rows.cat(parts)
    if all(isinstance(p, BlockQuantized) for p in parts):
        return parts
    if all(isinstance(p, (GroupedBlocks, BlockQuantized)) for p in parts):
        grouped = [p for p in parts if isinstance(p, GroupedBlocks)]
        perm, group = grouped[0].perm, max(p.group for p in grouped)
        as_grouped = [p if isinstance(p, GroupedBlocks) else GroupedBlocks([p]) for p in parts]
        if any(
            (p.perm is None) != (perm is None) or (perm is not None and not torch.equal(p.perm, perm))
            for p in as_grouped
        ):
            raise ValueError(
                f"{name}: the fused projections' act-order permutations (g_idx) differ; kvflow gathers one input "
                "permutation per fused projection"
            )
        offsets = None
        if group:
            if any(p.group not in (0, group) for p in as_grouped):
                raise ValueError(f"{name}: the fused projections' group sizes differ ({[p.group for p in as_grouped]})")
            n = as_grouped[0].shape[1]
            offsets = torch.cat(
                [p.offsets if p.offsets is not None else torch.zeros(p.shape[0], n // group) for p in as_grouped]
            )
        return GroupedBlocks([b for p in as_grouped for b in p.parts], perm, offsets, group)
    kinds = sorted({type(p).__name__ for p in parts})
    raise ValueError(
        f"{name}: its parts are stored in different kinds ({kinds}); quantize all of q/k/v (gate/up) alike, "
        "or none of them (an `ignore` list naming only some)"
    )


def _groups_index(in_features: int, groups: int) -> torch.Tensor:
    if in_features % groups:
        raise ValueError(f"{in_features} inputs are not {groups} equal groups")
    return torch.arange(in_features) // (in_features // groups)


def _unpack_along_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] with 32 / bits values per word, value j of a word in bits [j*bits, (j+1)*bits)
    -> int32 [..., n * 32 / bits] (GPTQ's packing, and compressed-tensors' for 4 and 8 bits)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    vals = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per)


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    zero_offset: int,
) -> IntGroups:
    """GPTQ: qweight int32 [in * bits / 32, out] packed along the inputs, qzeros int32
    [groups, out * bits / 32] packed along the outputs (v1 stores zero - 1: `zero_offset` 1),
    scales [groups, out], g_idx [in] (absent: i // group_size)."""
    codes = _unpack_along_last(qweight.t(), bits)  # [out, in]
    zero = _unpack_along_last(qzeros, bits).t() + zero_offset  # [out, groups]
    scale = scales.float().t().contiguous()
    out, in_features = codes.shape
    if zero.shape != scale.shape or scale.shape[0] != out:
        raise ValueError(
            f"GPTQ tensors disagree: qweight gives {out} outputs, qzeros {tuple(zero.shape)}, scales {tuple(scale.shape)}"
        )
    idx = _groups_index(in_features, scale.shape[1]) if g_idx is None else g_idx.to(torch.int64)
    if idx.shape != (in_features,) or int(idx.min()) < 0 or int(idx.max()) >= scale.shape[1]:
        raise ValueError(f"g_idx must hold {in_features} group indices below {scale.shape[1]}")
    return IntGroups(bits, codes.to(torch.uint8).contiguous(), scale, zero.contiguous(), idx)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> IntGroups:
    """AWQ GEMM: qweight int32 [in, out / 8], qzeros int32 [groups, out / 8] (output columns in
    AWQ_ORDER within each word), scales [groups, out]."""
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # column c sits in nibble inverse[c]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        nib = _unpack_along_last(words, 4).reshape(words.shape[0], -1, 8)
        return nib[:, :, inverse].reshape(words.shape[0], -1)

    codes = unpack(qweight).t()  # [out, in]
    zero = unpack(qzeros).t()
    scale = scales.float().t().contiguous()
    if zero.shape != scale.shape or scale.shape[0] != codes.shape[0]:
        raise ValueError(
            f"AWQ tensors disagree: qweight gives {codes.shape[0]} outputs, qzeros {tuple(zero.shape)}, "
            f"scales {tuple(scale.shape)}"
        )
    idx = _groups_index(codes.shape[1], scale.shape[1])
    return IntGroups(4, codes.to(torch.uint8).contiguous(), scale, zero.contiguous(), idx)


def unpack_compressed_tensors(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    shape: tuple[int, int],
    bits: int,
    g_idx: torch.Tensor | None = None,
) -> IntGroups:
    """compressed-tensors' pack-quantized: weight_packed int32 [out, in * bits / 32] (value j at
    bit j * bits of the row's little-endian bit stream, stored as q + 2^(bits-1)), weight_scale
    [out, groups] (or [out, 1] per channel, [1] per tensor), weight_zero_point (asymmetric only)
    packed the same way along the outputs, [out * bits / 32, groups]; and int-quantized 8-bit
    (`packed` is the int8 weight itself)."""
    out, in_features = shape
    half = 1 << (bits - 1)
    if packed.dtype == torch.int8:
        codes = packed.to(torch.int32) + half
    else:
        codes = _unpack_along_last(packed, bits)[:, :in_features]
    if tuple(codes.shape) != (out, in_features):
        raise ValueError(f"packed weight unpacks to {tuple(codes.shape)}, weight_shape says {(out, in_features)}")
    scale = scale.float().reshape(-1, 1).expand(out, 1) if scale.numel() == 1 else scale.float().reshape(out, -1)
    if zero_point is None:
        zero = torch.full(scale.shape, half, dtype=torch.int32)
    else:
        zero = _unpack_along_last(zero_point.t(), bits)[:, :out].t() if zero_point.dtype == torch.int32 else zero_point
        zero = zero.to(torch.int32).reshape(scale.shape) + (0 if zero_point.dtype == torch.int32 else half)
    idx = _groups_index(in_features, scale.shape[1]) if g_idx is None else g_idx.to(torch.int64)
    return IntGroups(bits, codes.to(torch.uint8).contiguous(), scale.contiguous(), zero.contiguous(), idx)


def to_blocks(w: IntGroups) -> BlockQuantized | GroupedBlocks:
    """`w` as GGUF blocks of 32 inputs (see the module docstring for the format chosen and its
    rounding); a GroupedBlocks when `g_idx` is not in order or an asymmetric 4-bit format's groups
    are wider than 32 inputs."""
    out, in_features = w.codes.shape
    if in_features % 32:
        raise ValueError(f"4/8-bit weights need a multiple of 32 inputs for the block kernels, got {in_features}")
    perm = None
    g = w.g_idx
    if bool((g[1:] < g[:-1]).any()):  # act-order: make each group's columns contiguous
        perm = torch.argsort(g, stable=True)
        g = g[perm]
    block_group = g.reshape(-1, 32)
    if not bool((block_group == block_group[:, :1]).all()):
        raise ValueError(
            "a quantization group is not a whole number of 32-input blocks (group sizes must be multiples of 32)"
        )
    codes = w.codes if perm is None else w.codes[:, perm]
    bg = block_group[:, 0]
    half = 1 << (w.bits - 1)
    symmetric = bool((w.zero == half).all())
    counts = torch.bincount(g, minlength=w.scale.shape[1])
    group = int(counts[0])
    # Asymmetric 4-bit groups of 64+ inputs: Q4_0 blocks of s * (q - 8) plus one float32 offset
    # s * (8 - z) per group (exact), instead of Q4_1 repeating an fp16 offset in every block.
    split = w.bits == 4 and not symmetric and group > 32 and bool((counts == group).all())
    scale = w.scale[:, bg].reshape(-1, 1)  # [out * blocks, 1]
    zero = w.zero[:, bg].reshape(-1, 1)
    q = codes.reshape(-1, 32)
    d = scale.half().view(torch.uint8).reshape(-1, 2)
    if w.bits == 8:
        if not symmetric:
            raise ValueError("8-bit weights with zero points other than 128 have no block format (Q8_0 is symmetric)")
        body = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        fmt, head = FORMATS["Q8_0"], [d]
    elif w.bits == 4:
        body = q[:, :16] | (q[:, 16:] << 4)
        if symmetric or split:
            fmt, head = FORMATS["Q4_0"], [d]
        else:
            m = (-zero.float() * scale).half().view(torch.uint8).reshape(-1, 2)
            fmt, head = FORMATS["Q4_1"], [d, m]
    else:
        raise ValueError(f"no block format for {w.bits}-bit weights")
    blocks = BlockQuantized(fmt, torch.cat([*head, body], dim=1).reshape(out, -1).contiguous())
    if split:
        offsets = (w.scale * (half - w.zero).float()).contiguous()  # [out, groups], in group order
        return GroupedBlocks([blocks], perm, offsets, group)
    return blocks if perm is None else GroupedBlocks([blocks], perm)


def to_int8_rows(w: IntGroups) -> Int8Rows:
    """8-bit symmetric per-channel codes as the int8 path's weights (W8A8)."""
    if w.bits != 8 or w.scale.shape[1] != 1 or not bool((w.zero == 128).all()):
        raise ValueError("W8A8 needs 8-bit symmetric weights with one scale per output channel")
    q = (w.codes.to(torch.int16) - 128).to(torch.int8)
    return Int8Rows(q.contiguous(), w.scale[:, 0].contiguous())
