"""The batched LoRA compute, as a wrapper around a projection's kernel.

The model runner sets one `LoRABatch` per step: groups of rows, each with the resident adapter
they run under (rows of the base model are in no group). The model stays request-agnostic: it
only ever sees rows and weights. Each wrapped projection computes its base output with its own
kernel, untouched, then for each group adds scaling * B (A x) over that group's rows: the shrink
(x @ A^T, [rows, R]) and the expand (@ (s B)^T, [rows, out]) pair of Punica/S-LoRA, one per
adapter group. With no group set (no adapter in the step) the wrapper only calls the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvflow.kernels.norm import rms_norm
from kvflow.lora.adapter import FUSED_PARTS, BaseShapes, ProjectionShape

Rows = slice | torch.Tensor  # a contiguous run of rows, or their indices (int64)


@dataclass
class LoRABatch:
    """This step's rows per adapter: (rows, the adapter's per-layer weights). Empty: no adapter."""

    groups: list[tuple[Rows, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]] = field(default_factory=list)


class LoRAKernel:
    """A projection kernel with the step's adapters added to its output (see the module doc).

    Takes the kernel's `norm=` / `silu_mul=` arguments (native kernels apply the input norm and
    the activation themselves): the adapter's input is then computed in torch, for the adapter
    rows only."""

    def __init__(self, inner, layer: int, proj: str, batch: LoRABatch) -> None:
        self.inner, self.layer, self.proj, self.batch = inner, layer, proj, batch
        self.backend = inner.backend
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        out = self.inner(x, residual, **kwargs)
        if not self.batch.groups:
            return out
        x2 = x.reshape(out.shape[0], -1)
        norm, silu_mul = kwargs.get("norm"), kwargs.get("silu_mul", False)
        for rows, weights in self.batch.groups:
            ab = weights[self.layer].get(self.proj)
            if ab is None:
                continue
            a_t, b_t = ab
            contiguous = isinstance(rows, slice)
            xs = x2[rows] if contiguous else x2.index_select(0, rows)
            if norm is not None:
                xs = rms_norm(xs, norm.weight, norm.eps)
            if silu_mul:
                gate, up = xs.chunk(2, dim=-1)
                xs = F.silu(gate) * up
            shrunk = xs @ a_t  # [rows, R]
            if contiguous:
                out[rows].addmm_(shrunk, b_t)  # in place: a view of the output
            else:
                out.index_add_(0, rows, shrunk @ b_t)
        return out

    def __getattr__(self, name: str):
        # (only reached for attributes not set above: whatever else a caller reads of the kernel)
        return getattr(self.__dict__["inner"], name)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def base_shapes(model: torch.nn.Module) -> BaseShapes:
    """Per decoder layer of `model`, the fused projections an adapter can target and their parts."""
    shapes: BaseShapes = []
    for layer in model.layers:
        per: dict[str, ProjectionShape] = {}
        for proj in FUSED_PARTS:
            lin = getattr(layer, proj, None)
            if lin is None or not hasattr(lin, "kernel"):
                continue
            if proj == "qkv_proj":
                if not hasattr(layer, "q_size"):
                    continue
                parts = (("q_proj", layer.q_size), ("k_proj", layer.kv_size), ("v_proj", layer.kv_size))
                if sum(n for _, n in parts) != lin.out_features:
                    continue  # a family with another fused layout: not adaptable
            elif proj == "gate_up_proj":
                half = lin.out_features // 2
                parts = (("gate_proj", half), ("up_proj", half))
            else:
                parts = ((proj, lin.out_features),)
            per[proj] = ProjectionShape(lin.in_features, parts)
        shapes.append(per)
    return shapes


def attach(model: torch.nn.Module, batch: LoRABatch) -> None:
    """Wrap every adaptable projection's kernel (after `prepare`: the kernels are final)."""
    for i, (layer, shape) in enumerate(zip(model.layers, base_shapes(model))):
        for proj in shape:
            lin = getattr(layer, proj)
            if not isinstance(lin.kernel, LoRAKernel):
                lin.kernel = LoRAKernel(lin.kernel, i, proj, batch)
