"""The batched LoRA compute, as a wrapper around a projection's kernel.

The runner's `LoRAManager` keeps the resident adapters stacked by slot, per layer and projection
(`LoRABatch.slots`), and sets each step's rows under adapters (`LoRABatch.rows`, grouped by
slot; rows of the base model are in none). The model stays request-agnostic: it only ever sees
rows, slots and weights. Each wrapped projection computes its base output with its own kernel,
untouched, then adds every adapter row's scaling * B (A x) in one call for all the step's
adapters (kvflow.kernels.cpu.lora.add_lora). Decode-only steps that the fused native decode pass
takes run the same shrink / expand inside the pass (kvflow.models.decode_pass), so a row gets the
same result either way. With no rows set (no adapter in the step) the wrapper only calls the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.kernels.cpu.lora import LoRAProjection, LoRARows, add_lora
from kvflow.lora.adapter import FUSED_PARTS, BaseShapes, ProjectionShape


@dataclass
class LoRABatch:
    """The resident adapters, per layer: fused projection -> its slots; and this step's rows under
    adapters (None: no adapter in the step)."""

    slots: list[dict[str, LoRAProjection]] = field(default_factory=list)
    rows: LoRARows | None = None


class LoRAKernel:
    """A projection kernel with the step's adapters added to its output (see the module doc).

    Takes the kernel's `norm=` / `silu_mul=` arguments (native kernels apply the input norm and
    the activation themselves): the adapters' input is computed the same way, for the adapter
    rows only."""

    def __init__(self, inner, layer: int, proj: str, batch: LoRABatch) -> None:
        self.inner, self.layer, self.proj, self.batch = inner, layer, proj, batch
        self.backend = inner.backend
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        out = self.inner(x, residual, **kwargs)
        rows = self.batch.rows
        if rows is None:
            return out
        out2 = out.view(-1, out.shape[-1])
        add_lora(
            self.batch.slots[self.layer][self.proj],
            rows,
            x.reshape(out2.shape[0], -1),
            out2,
            kwargs.get("norm"),
            kwargs.get("silu_mul", False),
        )
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
    """Wrap every adaptable projection's kernel (after `prepare`: the kernels are final), and
    hand the adapters to the fused decode pass where the model has one."""
    for i, (layer, shape) in enumerate(zip(model.layers, base_shapes(model))):
        for proj in shape:
            lin = getattr(layer, proj)
            if not isinstance(lin.kernel, LoRAKernel):
                lin.kernel = LoRAKernel(lin.kernel, i, proj, batch)
    if getattr(model, "native_decode", None) is not None:
        model.native_decode.use_lora(batch)
