"""Multi-LoRA serving: PEFT adapters over one base model, many in one batch (docs/features/lora.md).

`request` (LoRARequest, no torch) is what the engine and the server pass around; `adapter` loads
and checks a PEFT adapter onto kvflow's fused projections; `layers` wraps each adaptable
projection's kernel with the batched compute (kvflow.kernels.cpu.lora, which the fused decode
pass runs too); `manager` keeps adapters in CPU memory and in resident slots (stacked per layer
and projection) and builds each step's rows per slot."""

from kvflow.lora.request import LoRARequest

__all__ = ["LoRARequest"]
