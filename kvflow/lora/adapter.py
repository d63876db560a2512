"""Loading a PEFT LoRA adapter onto kvflow's fused projections.

PEFT stores, per adapted module, `lora_A` [r, in] and `lora_B` [out, r]; the module computes
W x + scaling * B (A x), scaling = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA), both per
module where `rank_pattern` / `alpha_pattern` say so. kvflow fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`: an adapter keeps, per fused projection, each part's A [r, in] and
(scaling * B)^T [r, out_part] (None for a part it does not adapt), in float32, which the
`LoRAManager` writes into a resident slot (kvflow.kernels.cpu.lora.LoRAProjection), where one
shrink and one expand per fused projection serve all its parts and all the step's adapters.

Every check happens here, at load: a bad adapter is a ValueError naming the module, never a
failure in the middle of a batch.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvflow.kernels.cpu.lora import PartWeights

# HF module name -> (kvflow's fused projection, index of the part in it)
PART_OF: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# HF modules that some checkpoints already fuse (Phi-3's `qkv_proj`, `gate_up_proj`): an adapter on
# one holds one A and the whole projection's B, whose rows split into the parts.
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
# B's rows for a part (an HF module name, e.g. "o_proj") as the model holds that module's weight
# rows: what its load did to them (Granite scales o_proj and down_proj; a partial rotary reorders
# q and k), done to the update too (the model's `adapter_rows`).
AdapterRows = Callable[[str, torch.Tensor], torch.Tensor]
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ProjectionShape:
    """One fused projection of the base model: its input features and its parts' output features
    in fused order (e.g. qkv_proj: q, k, v)."""

    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)


BaseShapes = list[dict[str, ProjectionShape]]  # per decoder layer: fused projection name -> shape


@dataclass
class LoRAAdapter:
    """An adapter in kvflow's layout: per layer, per fused projection it adapts, per part of it in
    fused order, (A [r, in], (scaling * B)^T [r, out_part]) in float32, or None."""

    name: str
    int_id: int
    path: str
    weights: list[dict[str, list[PartWeights | None]]]
    max_rank: int
    modules: list[str] = field(default_factory=list)  # the HF module names it adapts (deduplicated)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for w in self.weights
            for parts in w.values()
            for a, b in filter(None, parts)
        )


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module
    name (as a regex, at a dot boundary)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} must be a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"LoRA adapter {path!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {path!r}: modules_to_save {cfg['modules_to_save']!r} is not supported "
            "(only LoRA on q/k/v/o/gate/up/down_proj)"
        )
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path!r}: fan_in_fan_out=true is not supported (Llama-style Linear layers)")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, WEIGHTS_FILES[0])
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILES[0]} (save the adapter with safe_serialization)")


def _part(a: torch.Tensor, b: torch.Tensor, scaling: float) -> PartWeights:
    """A part as a slot takes it: A [r, in], (scaling * B)^T [r, out] (float32: the sums' type)."""
    return a.float().contiguous(), (b.float() * scaling).t().contiguous()


def load_adapter(
    name: str,
    int_id: int,
    path: str,
    shapes: BaseShapes,
    max_rank: int,
    rows: AdapterRows | None = None,
) -> LoRAAdapter:
    """Read and check the PEFT adapter at `path` against the base model's `shapes`; ValueError
    naming the module for an unknown module, a shape that does not fit, a rank > `max_rank`.
    `rows`: the model's `adapter_rows` (None: B's rows as they are)."""
    where = f"LoRA adapter {name!r} ({path})"
    if not os.path.isdir(path):
        raise ValueError(f"{where}: not a folder")
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    default_r, default_alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    known = (*PART_OF, *FUSED_MODULES)
    # (layer, hf module) -> {"A": tensor, "B": tensor}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    full_names: dict[tuple[int, str], str] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{where}: unknown module {key!r}; LoRA is supported on the decoder layers' {', '.join(known)} only"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in known:
            raise ValueError(
                f"{where}: unknown module {module!r} in {key!r}; LoRA is supported on {', '.join(known)} only"
            )
        if layer >= len(shapes):
            raise ValueError(f"{where}: {key!r} is for layer {layer}, the base model has {len(shapes)} layers")
        fused = module if module in FUSED_MODULES else PART_OF[module][0]
        if fused not in shapes[layer]:
            raise ValueError(f"{where}: the base model's layer {layer} has no {module} ({key!r})")
        found.setdefault((layer, module), {})[which] = t
        section = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
        full_names[(layer, module)] = f"model.layers.{layer}.{section}.{module}"
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILES[0]} holds no LoRA weights")
    weights: list[dict[str, list[PartWeights | None]]] = [{} for _ in shapes]
    parts_by_proj: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    top_rank = 0
    for (layer, module), ab in sorted(found.items()):
        mod = full_names[(layer, module)]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {mod} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        whole = module in FUSED_MODULES
        fused, index = (module, None) if whole else PART_OF[module]
        shape = shapes[layer][fused]
        in_f = shape.in_features
        out_f = shape.out_features if whole else shape.parts[index][1]
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(
                f"{where}: {mod}: lora_A / lora_B must be matrices, got {tuple(a.shape)} / {tuple(b.shape)}"
            )
        r = a.shape[0]
        if a.shape[1] != in_f or b.shape != (out_f, r):
            raise ValueError(
                f"{where}: {mod} does not fit the base model: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                f"expected lora_A (r, {in_f}) and lora_B ({out_f}, r) for {module} of {in_f} -> {out_f}"
            )
        if r > max_rank:
            raise ValueError(f"{where}: {mod} has rank {r}, above --max-lora-rank {max_rank}")
        expected_r = _pattern_value(rank_pattern, mod, default_r)
        if expected_r != r:
            raise ValueError(f"{where}: {mod} has rank {r} in its weights but {expected_r} in {CONFIG_FILE}")
        alpha = _pattern_value(alpha_pattern, mod, default_alpha)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        top_rank = max(top_rank, r)
        # (a fused module: every part shares its A and takes its own rows of B)
        split = b.split([n for _, n in shape.parts]) if whole else (b,)
        names = [part for part, _ in shape.parts] if whole else [module]
        got = parts_by_proj.setdefault((layer, fused), {})
        for part, rows_b in zip(names, split):
            if part in got:
                raise ValueError(f"{where}: {part} of layer {layer} is adapted twice (as {module} and on its own)")
            got[part] = (a, rows_b if rows is None else rows(part, rows_b), scaling)
    for (layer, fused), parts in parts_by_proj.items():
        weights[layer][fused] = [
            None if part not in parts else _part(*parts[part]) for part, _ in shapes[layer][fused].parts
        ]
    modules = sorted({m for _, m in found}, key=list(known).index)
    return LoRAAdapter(name, int_id, path, weights, top_rank, modules)
