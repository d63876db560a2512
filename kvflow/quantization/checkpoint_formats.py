"""The `quantization_config` of a HF checkpoint's config.json, parsed and validated: which formats
kvflow runs as stored (GPTQ, AWQ, compressed-tensors), with a clear error for anything else naming
the field and the values accepted.

Formats (what the tensors hold is in kvflow.quantization.packed_weights):

* ``gptq``  -- `bits` 4 or 8, `group_size` a multiple of 32 or -1 (one group per output channel),
  `sym` either way (the zero points are read from `qzeros` whatever `sym` says), `desc_act` with
  `g_idx`; `checkpoint_format` "gptq" (auto-gptq's v1: zeros stored minus one, which transformers /
  optimum / gptqmodel add back at load) or "gptq_v2" (stored as they are).
* ``awq``   -- `version` "gemm", 4 bits, `zero_point` true, `group_size` a multiple of 32.
* ``compressed-tensors`` -- one scheme (a `config_groups` entry) over the Linear layers but
  `ignore`: `pack-quantized` int weights of 4 or 8 bits without activation quantization (W4A16,
  W8A16), `int-quantized` 8-bit symmetric per-channel weights with dynamic per-token int8
  activations (W8A8), or without activation quantization (W8A16); `float-quantized` FP8 (e4m3)
  weights per channel or tensor, with dynamic per-token FP8 activations (llm-compressor's
  FP8_DYNAMIC) or none (W8A16). Block-wise FP8 scales and static activation scales are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


class UnsupportedQuantization(ValueError):
    """A `quantization_config` kvflow cannot run as stored (the message names the field)."""


@dataclass(frozen=True)
class CheckpointQuant:
    """One checkpoint's weight format.

    `method`: "gptq", "awq" or "compressed-tensors"; `layout` how its tensors are stored ("gptq",
    "awq", "ct-packed", "ct-int"); `bits`; `group_size` (-1: one group over all inputs);
    `zero_offset`: what to add to a stored zero point (GPTQ v1 stores zero - 1); `activations`:
    "none" (weights only, activations stay float), "int8-token" (dynamic per-token symmetric int8)
    or "fp8-token" (dynamic per-token float8 e4m3);
    `ignore`: module names or "re:" patterns kept in float; `targets`: what the scheme covers."""

    method: str
    layout: str
    bits: int
    group_size: int
    activations: str = "none"
    zero_offset: int = 0
    desc_act: bool = False
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def label(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        acts = {"none": "A16", "int8-token": "A8 (dynamic per-token int8)", "fp8-token": "A8 (dynamic per-token fp8)"}
        fp8 = " FP8" if self.layout == "ct-fp8" else ""
        return f"{self.method}{fp8} W{self.bits}{acts[self.activations]}, {group}"

    def covers(self, module: str) -> bool:
        """Whether the quantized tensors of `module` (e.g. "model.layers.0.mlp.down_proj") are
        expected in this format: covered by `targets` and not in `ignore`."""
        if any(_matches(p, module) for p in self.ignore):
            return False
        return any((t == "Linear" and is_linear(module)) or _matches(t, module) for t in self.targets)


def is_linear(module: str) -> bool:
    """Whether a checkpoint module name is a projection (what "Linear" targets): the *_proj layers
    of the decoder and the lm_head; not the embedding or the norms."""
    leaf = module.rpartition(".")[2]
    return leaf.endswith("proj") or leaf == "lm_head"


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _fail(field_name: str, value: Any, accepted: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"quantization_config.{field_name}={value!r} is not supported; kvflow runs {accepted}"
    )


def _group_size(value: Any, name: str) -> int:
    if value is None or value == -1:
        return -1
    if not isinstance(value, int) or value <= 0 or value % 32:
        raise _fail(name, value, "group sizes that are a multiple of 32 (32, 64, 128, ...) or -1 (per channel)")
    return value


def parse_quantization_config(qc: dict[str, Any]) -> CheckpointQuant:
    """The weight format a `quantization_config` announces, or UnsupportedQuantization."""
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _fail("quant_method", method, f"checkpoints quantized with {', '.join(QUANT_METHODS)}")


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _fail("bits", bits, "GPTQ with bits 4 or 8")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", fmt, "GPTQ checkpoints in format 'gptq' (v1) or 'gptq_v2'")
    if qc.get("lm_head"):
        raise _fail("lm_head", True, "GPTQ with a float lm_head (lm_head: false)")
    if qc.get("dynamic"):
        raise _fail("dynamic", qc["dynamic"], "GPTQ with one bits/group_size for every module (no 'dynamic')")
    return CheckpointQuant(
        method="gptq",
        layout="gptq",
        bits=bits,
        group_size=_group_size(qc.get("group_size", 128), "group_size"),
        zero_offset=1 if fmt == "gptq" else 0,
        desc_act=bool(qc.get("desc_act", False)),
        ignore=("lm_head",),
        raw=qc,
    )


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("version", qc.get("version"), "AWQ's GEMM packing (version 'gemm')")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _fail("bits", bits, "AWQ with 4 bits")
    if not qc.get("zero_point", True):
        raise _fail("zero_point", False, "AWQ with zero points (zero_point: true)")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return CheckpointQuant(
        method="awq",
        layout="awq",
        bits=4,
        group_size=_group_size(qc.get("group_size", qc.get("q_group_size", 128)), "group_size"),
        ignore=("lm_head", *ignore),
        raw=qc,
    )


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _fail(
            "config_groups", sorted(groups), "compressed-tensors checkpoints with exactly one scheme (config group)"
        )
    ((name, scheme),) = groups.items()
    fmt = scheme.get("format") or qc.get("format")
    if fmt == "float-quantized":
        return _compressed_tensors_fp8(qc, name, scheme)
    if fmt not in CT_FORMATS:
        raise _fail("format", fmt, f"compressed-tensors formats {CT_FORMATS}")
    w = scheme.get("weights") or {}
    where = f"config_groups.{name}.weights"
    if w.get("type", "int") != "int":
        raise _fail(f"{where}.type", w.get("type"), "int weights")
    bits = w.get("num_bits")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel", "tensor"):
        raise _fail(f"{where}.strategy", strategy, "weights quantized per group, channel or tensor")
    if w.get("dynamic"):
        raise _fail(f"{where}.dynamic", True, "static weight scales")
    if scheme.get("output_activations"):
        raise _fail(f"config_groups.{name}.output_activations", scheme["output_activations"], "no output quantization")
    if w.get("actorder") not in (None, "group", "static"):
        raise _fail(f"{where}.actorder", w.get("actorder"), "actorder null, 'group' or 'static'")
    group = _group_size(w.get("group_size"), f"{where}.group_size") if strategy == "group" else -1
    acts = scheme.get("input_activations")
    activations = "none"
    if acts:
        a_where = f"config_groups.{name}.input_activations"
        ok = (
            acts.get("type", "int") == "int"
            and acts.get("num_bits") == 8
            and acts.get("symmetric", True)
            and acts.get("dynamic") is True
            and acts.get("strategy") == "token"
        )
        if not ok:
            raise _fail(a_where, acts, "8-bit int activations quantized dynamically per token, symmetric")
        activations = "int8-token"
    if activations == "int8-token":
        if fmt == "pack-quantized" or bits != 8 or not w.get("symmetric", True) or strategy == "group":
            raise _fail(
                where, w, "W8A8 as 8-bit symmetric weights per channel or tensor (int-quantized), int8 activations"
            )
        layout = "ct-int"
    elif fmt == "pack-quantized":
        if bits not in (4, 8):
            raise _fail(f"{where}.num_bits", bits, "packed weights of 4 or 8 bits")
        layout = "ct-packed"
    else:
        if bits != 8:
            raise _fail(f"{where}.num_bits", bits, "int-quantized weights of 8 bits")
        layout = "ct-int"
    if bits == 8 and not w.get("symmetric", True):
        raise _fail(
            f"{where}.symmetric", False, "8-bit weights that are symmetric (Q8_0 and the int8 path have no zero point)"
        )
    targets = tuple(scheme.get("targets") or ("Linear",))
    return CheckpointQuant(
        method="compressed-tensors",
        layout=layout,
        bits=bits,
        group_size=group,
        activations=activations,
        desc_act=w.get("actorder") is not None,
        ignore=tuple(qc.get("ignore") or ()),
        targets=targets,
        raw=qc,
    )


def _compressed_tensors_fp8(qc: dict[str, Any], name: str, scheme: dict[str, Any]) -> CheckpointQuant:
    """`float-quantized`: float8 e4m3 weights with a float32 scale per output channel or per tensor
    (run as stored by the native float kernel, widened in registers); activations float (W8A16) or
    rounded to e4m3 per token with the scale max|x| / 448 (FP8_DYNAMIC)."""
    w = scheme.get("weights") or {}
    where = f"config_groups.{name}.weights"
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _fail(where, w, "float-quantized weights of type 'float', 8 bits (e4m3)")
    if w.get("strategy") not in ("channel", "tensor"):
        raise _fail(
            f"{where}.strategy",
            w.get("strategy"),
            "FP8 weights scaled per output channel or per tensor (not block-wise)",
        )
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise _fail(where, w, "symmetric FP8 weights with static scales")
    if scheme.get("output_activations"):
        raise _fail(f"config_groups.{name}.output_activations", scheme["output_activations"], "no output quantization")
    acts = scheme.get("input_activations")
    activations = "none"
    if acts:
        ok = (
            acts.get("type") == "float"
            and acts.get("num_bits") == 8
            and acts.get("dynamic") is True
            and acts.get("strategy") == "token"
        )
        if not ok:
            raise _fail(
                f"config_groups.{name}.input_activations",
                acts,
                "FP8 activations quantized dynamically per token (FP8_DYNAMIC); static activation scales are not "
                "supported",
            )
        activations = "fp8-token"
    return CheckpointQuant(
        method="compressed-tensors",
        layout="ct-fp8",
        bits=8,
        group_size=-1,
        activations=activations,
        ignore=tuple(qc.get("ignore") or ()),
        targets=tuple(scheme.get("targets") or ("Linear",)),
        raw=qc,
    )
