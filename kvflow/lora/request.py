"""`LoRARequest`: which adapter a request runs under, named as vLLM names it. No torch: the
scheduler, the engine and the server pass it around; only the runner's `LoRAManager` loads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`).

    `lora_int_id`: a positive id, unique per adapter (0 means "no adapter" internally);
    `lora_name`: what clients call it (the `model` field of an OpenAI request)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache adds to the hashes of this adapter's blocks: two adapters never
        share KV, the same adapter does."""
        return f"\0lora:{self.lora_name}\0{self.lora_path}".encode()
