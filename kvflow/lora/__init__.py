"""Multi-LoRA serving: PEFT adapters over one base model, many in one batch (docs/features/lora.md).

`request` (LoRARequest, no torch) is what the engine and the server pass around; `adapter` loads
and checks a PEFT adapter onto kvflow's fused projections; `layers` is the batched compute (a
wrapper around each adaptable projection's kernel); `manager` keeps adapters in CPU memory and in
resident slots and builds each step's row -> adapter groups."""

from kvflow.lora.request import LoRARequest

__all__ = ["LoRARequest"]
