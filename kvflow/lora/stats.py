"""What the engine reports of its LoRA adapters (no torch: the metrics read it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoRAStats:
    max_loras: int
    running: list[str] = field(default_factory=list)  # adapters of the running requests, by name
    waiting: list[str] = field(default_factory=list)  # adapters of the waiting requests
    loads: int = 0  # adapters read from their folder, since start
    evictions: int = 0  # resident adapters moved out of their slot (to CPU memory) for another one
    cpu_evictions: int = 0  # loaded adapters dropped from CPU memory (--max-cpu-loras)
