"""Reading a quantized HF checkpoint (GPTQ, AWQ, compressed-tensors; `quantization_config` in its
config.json): the packed tensors of each projection are gathered and handed to the model as
the kernels run them (GGUF blocks, int8 rows; kvflow.quantization.packed_weights), never as float.
Tensors the format does not cover (embeddings, norms, an ignored lm_head) pass through as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvflow.quantization.checkpoint_formats import CheckpointQuant
from kvflow.quantization.gguf_blocks import BlockQuantized
from kvflow.quantization.packed_weights import (
    Fp8Rows,
    GroupedBlocks,
    Int8Rows,
    IntGroups,
    to_blocks,
    to_int8_rows,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)

logger = logging.getLogger("kvflow")

# The tensors of one quantized projection, by layout (the first ones are required).
_PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "ct-packed": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx")),
    "ct-int": (("weight", "weight_scale"), ("weight_zero_point", "weight_g_idx")),
    "ct-fp8": (("weight", "weight_scale"), ("weight_zero_point",)),
}


@dataclass
class QuantizedLoadStats:
    """What the loader read and made: bytes of the packed tensors (as the file stores them) and of
    the weights as kernels take them, per output format."""

    packed_bytes: int = 0
    held_bytes: int = 0
    formats: dict[str, int] = field(default_factory=dict)  # format -> projections

    @property
    def ratio(self) -> float:
        return self.held_bytes / self.packed_bytes if self.packed_bytes else 0.0


def _held(w: BlockQuantized | Int8Rows | GroupedBlocks | Fp8Rows) -> tuple[int, str]:
    if isinstance(w, Fp8Rows):
        return w.q.numel() + 4 * w.scale.numel(), f"fp8 e4m3 ({'W8A8' if w.activations != 'none' else 'W8A16'})"
    if isinstance(w, Int8Rows):
        return w.q.numel() + 4 * w.scale.numel(), "int8 (W8A8)"
    if isinstance(w, GroupedBlocks):
        extra = sum(t.numel() * t.element_size() for t in (w.perm, w.offsets) if t is not None)
        how = [k for k, t in (("act-order", w.perm), ("group offsets", w.offsets)) if t is not None]
        return sum(p.nbytes for p in w.parts) + extra, f"{w.parts[0].format.name} + {' + '.join(how)}"
    return w.nbytes, w.format.name


def _split(name: str, layout: str) -> tuple[str, str] | None:
    module, _, suffix = name.rpartition(".")
    required, optional = _PARTS[layout]
    return (module, suffix) if suffix in required or suffix in optional else None


def quantized_weights(
    weights: Iterator[tuple[str, torch.Tensor]], quant: CheckpointQuant, stats: QuantizedLoadStats | None = None
) -> Iterator[tuple[str, torch.Tensor | BlockQuantized | Int8Rows | GroupedBlocks]]:
    """`weights` with each covered projection's packed tensors replaced by one "<module>.weight"
    in its kernel format (yielded after the float tensors, once every file was read: a
    projection's tensors may sit in different shards)."""
    stats = stats if stats is not None else QuantizedLoadStats()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = _split(name, quant.layout)
        if split is not None and quant.covers(split[0]):
            if split[1] == "weight" and tensor.is_floating_point() and tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"{name} is stored in float ({tensor.dtype}) but quantization_config covers {split[0]} "
                    f"({quant.label}); add it to `ignore`"
                )
            pending.setdefault(split[0], {})[split[1]] = tensor
            continue
        yield name, tensor
    required = _PARTS[quant.layout][0]
    for module, parts in pending.items():
        missing = [p for p in required if p not in parts]
        if missing:
            raise ValueError(f"quantized projection {module} lacks {missing} ({quant.label})")
        stats.packed_bytes += sum(t.numel() * t.element_size() for t in parts.values())
        if quant.layout == "ct-fp8":
            w = _fp8_rows(module, parts, quant)
        else:
            groups = _unpack(module, parts, quant)
            w = to_int8_rows(groups) if quant.activations == "int8-token" else to_blocks(groups)
        held, fmt = _held(w)
        stats.held_bytes += held
        stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
        yield f"{module}.weight", w
    if pending:
        kinds = ", ".join(f"{n} x {f}" for f, n in sorted(stats.formats.items()))
        logger.info(
            "%s: %d projections, %.2f MB packed, %.2f MB as the kernels hold them (%.2fx; %s)",
            quant.label,
            len(pending),
            stats.packed_bytes / 1e6,
            stats.held_bytes / 1e6,
            stats.ratio,
            kinds,
        )


def _unpack(module: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> IntGroups:
    try:
        if quant.layout == "gptq":
            g_idx = t.get("g_idx")
            if quant.desc_act and g_idx is None:
                raise ValueError("desc_act is set but the checkpoint has no g_idx")
            w = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, quant.bits, quant.zero_offset)
        elif quant.layout == "awq":
            w = unpack_awq(t["qweight"], t["qzeros"], t["scales"])
        else:
            packed = t["weight_packed"] if quant.layout == "ct-packed" else t["weight"]
            shape = tuple(int(v) for v in t["weight_shape"]) if "weight_shape" in t else tuple(packed.shape)
            if quant.layout == "ct-int" and packed.dtype != torch.int8:
                raise ValueError(f"int-quantized weights must be int8, got {packed.dtype}")
            w = unpack_compressed_tensors(
                packed, t["weight_scale"], t.get("weight_zero_point"), shape, quant.bits, t.get("weight_g_idx")
            )
    except (ValueError, RuntimeError, IndexError) as e:
        raise ValueError(f"quantized projection {module} ({quant.label}): {e}") from e
    groups = w.scale.shape[1]
    in_features = w.codes.shape[1]
    expected = 1 if quant.group_size == -1 else in_features // quant.group_size
    if groups != expected:
        raise ValueError(
            f"quantized projection {module}: {groups} scale groups over {in_features} inputs, but "
            f"quantization_config's group_size {quant.group_size} gives {expected}"
        )
    return w


def _fp8_rows(module: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> Fp8Rows:
    """A float-quantized projection as stored: e4m3 weights, the scale per channel (a per-tensor
    one repeated over the channels)."""
    q, scale = t["weight"], t["weight_scale"].float().reshape(-1)
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(
            f"quantized projection {module} ({quant.label}): weight must be 2-D float8_e4m3fn, got {q.dtype}"
        )
    zp = t.get("weight_zero_point")
    if zp is not None and bool(zp.ne(0).any()):
        raise ValueError(f"quantized projection {module} ({quant.label}): FP8 weights with nonzero zero points")
    out = q.shape[0]
    if scale.numel() == 1:
        scale = scale.expand(out).clone()
    if scale.numel() != out:
        raise ValueError(
            f"quantized projection {module} ({quant.label}): {scale.numel()} weight scales for {out} output channels"
        )
    return Fp8Rows(q.contiguous(), scale.contiguous(), quant.activations)
