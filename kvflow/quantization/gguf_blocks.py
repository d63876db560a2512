"""Block-quantized weights in GGUF's formats: the tensors of a GGUF file kept as they are stored, and
`--quantization int4` (round-to-nearest into the same 4-bit blocks at load).

A `BlockQuantized` is a weight [rows, cols] as `rows` rows of bytes, each the blocks of one output
channel over all inputs in GGML's layout (see kvflow/kernels/cpu/csrc/block_linear.cpp for the
formats). Rows can be permuted, sliced and concatenated without touching the blocks, which is all
the loader and the model need (llama.cpp's Q/K row order, fused q|k|v and gate|up). `dequantize`
is the float32 view (the `--gguf-weights dequantize` path), in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    block_values: int
    block_bytes: int
    # Byte offsets in a block of the fp16 numbers that every value it holds is linear in (d; Q4_1's
    # m, Q4_K's dmin): scaling them all scales the block (`BlockQuantized.scaled`).
    fp16_scales: tuple[int, ...] = (0,)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20, (0, 2)),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, 256, 144, (0, 2)),
        BlockFormat("Q6_K", 14, 256, 210, (208,)),
    )
}


@dataclass
class BlockQuantized:
    """`rows` x `cols` weights in `format`: `data` is uint8 [rows, cols / block_values * block_bytes]."""

    format: BlockFormat
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError("block-quantized data must be a 2-D uint8 tensor (one row of blocks per channel)")
        if self.data.shape[1] % self.format.block_bytes:
            raise ValueError(
                f"{self.format.name} rows of {self.data.shape[1]} bytes are not whole blocks "
                f"of {self.format.block_bytes}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // self.format.block_bytes * self.format.block_values

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def with_rows(self, data: torch.Tensor) -> BlockQuantized:
        return BlockQuantized(self.format, data)

    def split_rows(self, n: int) -> list[BlockQuantized]:
        """`n` weights of rows / n channels each (views, no copy): a 3-D expert tensor's rows,
        expert by expert."""
        rows = self.data.shape[0]
        if n < 1 or rows % n:
            raise ValueError(f"cannot split {rows} rows of {self.format.name} blocks into {n} equal parts")
        return [self.with_rows(part) for part in self.data.split(rows // n)]

    def dequantize(self) -> torch.Tensor:
        return dequantize_rows(self.format, self.data)

    def scaled(self, factor: float) -> BlockQuantized:
        """The weight times `factor`, still in blocks: each block's fp16 scales multiplied (in
        float32, rounded to fp16: within 2^-11 of the exact product, relative). ValueError when a
        scale would leave fp16's range."""
        blocks = self.data.reshape(-1, self.format.block_bytes).clone()
        for at in self.format.fp16_scales:
            old = blocks[:, at : at + 2].contiguous().view(torch.float16).float()
            new = old * factor
            if not torch.isfinite(new).all() or new.abs().max() > torch.finfo(torch.float16).max:
                raise ValueError(f"{self.format.name} blocks scaled by {factor}: a block scale leaves fp16's range")
            blocks[:, at : at + 2] = new.half().view(torch.uint8).reshape(-1, 2)
        return self.with_rows(blocks.reshape(self.data.shape))


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # A 32-value block's 16 bytes hold values 0..15 in their low nibbles and 16..31 in their high ones.
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 8 (scale, min) pairs of 6 bits packed in 12 bytes -> two [blocks, 8] tensors."""
    s = s.to(torch.int32)
    lo_sc, lo_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), 1).float(), torch.cat((lo_mn, hi_mn), 1).float()


def dequantize_rows(fmt: BlockFormat, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] from uint8 rows of `fmt` blocks."""
    rows = data.shape[0]
    b = data.reshape(-1, fmt.block_bytes)
    if fmt.name == "Q8_0":
        out = b[:, 2:].view(torch.int8).float() * _f16(b, 0)
    elif fmt.name == "Q4_0":
        out = _f16(b, 0) * (_nibbles(b[:, 2:]).view(torch.int8) - 8).float()
    elif fmt.name == "Q4_1":
        out = _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)
    elif fmt.name == "Q4_K":
        sc, mn = _k4_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2j (low), 2j + 1 (high nibbles)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32).float()
        out = (_f16(b, 0)[:, :, None] * sc[:, :, None] * q - _f16(b, 2)[:, :, None] * mn[:, :, None]).reshape(-1, 256)
    elif fmt.name == "Q6_K":
        ql = b[:, :128].reshape(-1, 2, 2, 32).to(torch.int32)  # [half, ql[0:32] | ql[32:64], 32]
        qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # quarters 0, 1 (low nibbles), 2, 3 (high)
        high = torch.cat([(qh >> (2 * t)) & 3 for t in range(4)], dim=2)
        q = (low | (high << 4)) - 32  # [blocks, 2 halves, 4 quarters, 32]
        sc = b[:, 192:208].view(torch.int8).float().reshape(-1, 2, 4, 2, 1)  # scale per 16 values
        out = (_f16(b, 208).reshape(-1, 1, 1, 1, 1) * sc * q.float().reshape(-1, 2, 4, 2, 16)).reshape(-1, 256)
    else:
        raise ValueError(f"no dequantization for {fmt.name}")
    return out.reshape(rows, -1)


# --------------------------------------------------------------------------------------------------
# Round-to-nearest quantization into blocks (`--quantization int4`, and the int4 lm_head's Q8_0)
# --------------------------------------------------------------------------------------------------


def quantize(w: torch.Tensor, name: str) -> BlockQuantized:
    """`w` [rows, cols] (cols a multiple of 32) to Q4_0 (symmetric 4-bit), Q4_1 (4-bit with an
    offset: min and max of the block exact) or Q8_0, round to nearest, fp16 scales, as llama.cpp
    quantizes them."""
    fmt = FORMATS[name]
    if name not in ("Q4_0", "Q4_1", "Q8_0"):
        raise ValueError(f"quantize supports Q4_0, Q4_1 and Q8_0, not {name}")
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"block quantization needs a multiple of 32 inputs, got {cols}")
    x = w.detach().float().reshape(-1, 32)
    if name == "Q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        q = torch.round(x / torch.where(d > 0, d, 1)).clamp(-127, 127).to(torch.int8)
        body = q.view(torch.uint8)
        head = [d.half()]
    elif name == "Q4_0":
        # llama.cpp: the value of largest magnitude maps to -8, so the scale may be negative.
        idx = x.abs().argmax(1, keepdim=True)
        d = x.gather(1, idx) / -8
        q = (torch.round(x / torch.where(d != 0, d, 1)) + 8).clamp(0, 15).to(torch.uint8)
        body, head = q[:, :16] | (q[:, 16:] << 4), [d.half()]
    else:
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.round((x - lo) / torch.where(d > 0, d, 1)).clamp(0, 15).to(torch.uint8)
        body, head = q[:, :16] | (q[:, 16:] << 4), [d.half(), lo.half()]
    blocks = torch.cat([*(h.view(torch.uint8) for h in head), body], dim=1)
    return BlockQuantized(fmt, blocks.reshape(rows, -1).contiguous())
