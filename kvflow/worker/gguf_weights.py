"""`--gguf-weights auto`: a GGUF's quantized tensors run as stored (the block kernels) or are
dequantized to a float dtype at load, whichever computes a batched decode step faster on this CPU,
by measurement.

Which is faster is the CPU's question: on the AVX-512 EPYC measured so far the blocks served more
than either float path at 64 requests, while on an AMX Xeon the bfloat16 path (AMX tiles) can
serve more than the blocks (docs/benchmarks/results/). So nothing is written down: `choose`
times the model's own projections -- one decoder layer's q|k|v, o, gate|up and down, fused as the
model holds them, and the logits -- at `ROWS` rows, the blocks against each float dtype the CPU
multiplies natively (float32; bfloat16 where it has bf16 products: AVX512-BF16 or AMX), each float
shape through the fastest of the linear kernels' paths (what the autotune would pick), timed as
the autotune times its choices (`best_times`: interleaved, best of its rounds); a step's projections
are layers x one layer + the logits. A float path is taken when its step at the batched row count
(the last of `ROWS`) is faster than the blocks' by `MARGIN` and its weights fit in `MEMORY_SHARE` of
the memory available now; the log gives every time, the one-row times too (where the blocks
usually win: a decode of a few requests reads fewer bytes).

What the choice changes: native keeps the file's bytes (activations rounded to int8 per block of
32); float32 runs the file's values exactly (HF equivalence on the dequantized weights);
bfloat16 rounds each weight to bf16 and runs the model in bf16 (the engine's dtype becomes
bfloat16), so outputs can differ from the blocks' and float32's. The times are stored beside the
autotune's (keyed by the CPU, torch, the thread count, the kernels' sources and the tensors' shapes
and formats); later starts read them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvflow.config import EngineConfig
from kvflow.kernels.cpu import native
from kvflow.utils.memory import meminfo_bytes
from kvflow.worker.autotune import best_times, store_dir, write_json

logger = logging.getLogger(__name__)

ROWS = (1, 64)  # one request decoding, and 64 at once (the batched decode the choice is for)
MARGIN = 0.05  # a float path must be this much faster at ROWS[-1] (timing noise must not flip it)
MEMORY_SHARE = 0.5  # of MemAvailable, for the dequantized weights
# The projections of one decoder layer, fused as the model holds them: (module, parts).
LAYER_PARTS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", ("o_proj",)),
    ("mlp", ("gate_proj", "up_proj")),
    ("mlp", ("down_proj",)),
)
VERSION = 1


@dataclass(frozen=True)
class Choice:
    gguf_weights: str  # "native" or "dequantize"
    dtype: str  # the engine's dtype with it
    # seconds of a decode step's projections at each of ROWS, per candidate ("blocks", "float32",
    # "bfloat16"); empty where nothing was timed
    times: dict[str, dict[int, float]]
    why: str


def resolve(config: EngineConfig) -> EngineConfig:
    """`config` with gguf_weights "auto" decided (native or dequantize, and the dtype that goes with
    it); any other config as it is."""
    if config.gguf_weights != "auto":
        return config
    choice = choose(config)
    chosen = "blocks as stored" if choice.gguf_weights == "native" else f"dequantized to {choice.dtype}"
    logger.info("--gguf-weights auto: %s (%s)", chosen, choice.why)
    return replace(config, gguf_weights=choice.gguf_weights, dtype=choice.dtype)


def choose(config: EngineConfig) -> Choice:
    from kvflow.models.loader import resolve_model_path, why_no_block_kernels

    path = resolve_model_path(config.model)
    if not path.endswith(".gguf"):
        return Choice("dequantize", config.dtype, {}, "not a GGUF: nothing to choose")
    blocked = why_no_block_kernels(config)
    if blocked is not None:
        return Choice("dequantize", config.dtype, {}, blocked)
    from kvflow.kernels.cpu.float_linear import bf16_dot
    from kvflow.models.gguf_loader import load_gguf

    g = load_gguf(path, with_tokenizer=False, keep_blocks=True)
    parts = _projections(g.tensors)
    if parts is None:
        return Choice("native", "float32", {}, "the GGUF's first layer has no block-quantized projections to time")
    layers = int(g.hf_config.get("num_hidden_layers") or 1)
    dtypes = ["float32", *(["bfloat16"] if bf16_dot() else [])]
    key = _key(parts, layers, dtypes)
    store = _store_path(key)
    times = _read(store)
    source = "stored"
    if times is None:
        t0 = time.perf_counter()
        times = measure(parts, layers, dtypes)
        source = f"measured in {time.perf_counter() - t0:.1f} s"
        _write(store, times)
    return decide(times, _float_params(g.tensors), meminfo_bytes("MemAvailable"), source)


def decide(times: dict[str, dict[int, float]], float_params: int, available: float | None, source: str) -> Choice:
    """The choice from the step times (`float_params`: the weights' element count once dequantized;
    `available`: bytes of memory available, None where unknown)."""
    rows = ROWS[-1]
    blocks = times["blocks"][rows]
    shown = "; ".join(
        f"{c} " + ", ".join(f"{1e3 * t:.2f} ms at {r} row{'s' if r > 1 else ''}" for r, t in sorted(by.items()))
        for c, by in times.items()
    )
    best = min((c for c in times if c != "blocks"), key=lambda c: times[c][rows], default=None)
    if best is None or times[best][rows] > blocks * (1 - MARGIN):
        return Choice("native", "float32", times, f"a decode step's projections: {shown}; {source}")
    need = float_params * getattr(torch, best).itemsize
    if available is not None and need > MEMORY_SHARE * available:
        return Choice(
            "native",
            "float32",
            times,
            f"{best} would be faster ({shown}) but its weights, {need / 1e9:.1f} GB, are more than "
            f"{MEMORY_SHARE:.0%} of the {available / 1e9:.1f} GB available; {source}",
        )
    return Choice("dequantize", best, times, f"a decode step's projections: {shown}; {source}")


def measure(parts: dict[str, list], layers: int, dtypes: list[str]) -> dict[str, dict[int, float]]:
    """Seconds of a decode step's projections (layers x the first layer's + the logits) at each of
    ROWS, for the blocks and each float dtype: every kernel timed as the autotune times its choices
    (once to warm, then its ROUNDS sweeps interleaved across candidates, best of each)."""
    from kvflow.kernels.cpu.block_linear import BlockQuantKernel
    from kvflow.layers.linear_kernels import candidates, make_path_kernel
    from kvflow.quantization.gguf_blocks import dequantize_rows

    # (candidate, projection) -> its kernels: the blocks' one; a float dtype's, one per linear path
    kernels: dict[tuple[str, str], list] = {}
    for name, blocks in parts.items():
        kernels[("blocks", name)] = [BlockQuantKernel(blocks)]
        w = torch.cat([dequantize_rows(b.format, b.data).reshape(b.shape) for b in blocks]).float()
        for d in dtypes:
            dt = getattr(torch, d)
            kernels[(d, name)] = [make_path_kernel(p, w.to(dt)) for p in candidates(dt)]
    g = torch.Generator().manual_seed(0)
    variants = [(c, name, i) for (c, name), ks in kernels.items() for i in range(len(ks))]
    best: dict[tuple[str, str, int, int], float] = {}
    for r in ROWS:
        x = {name: torch.randn(r, blocks[0].shape[1], generator=g) for name, blocks in parts.items()}
        xs = {(c, name): x[name].to(torch.float32 if c == "blocks" else getattr(torch, c)) for c, name in kernels}
        times = best_times(lambda v, xs=xs: kernels[v[:2]][v[2]](xs[v[:2]]), variants)
        best.update({(c, name, r, i): t for (c, name, i), t in times.items()})
    # a projection's time: its fastest path's; a step: layers x each layer projection + the logits
    step: dict[str, dict[int, float]] = {c: dict.fromkeys(ROWS, 0.0) for c in ("blocks", *dtypes)}
    for (c, name), ks in kernels.items():
        for r in ROWS:
            step[c][r] += (1 if name == "logits" else layers) * min(best[(c, name, r, i)] for i in range(len(ks)))
    return step


def _projections(tensors: dict) -> dict[str, list] | None:
    """The first layer's projections (fused as the model holds them) and the logits, as block-
    quantized parts; None where they are not all block-quantized."""
    from kvflow.quantization.gguf_blocks import BlockQuantized

    out: dict[str, list] = {}
    for module, group in LAYER_PARTS:
        names = [f"model.layers.0.{module}.{p}.weight" for p in group]
        blocks = [tensors.get(n) for n in names]
        if not all(isinstance(b, BlockQuantized) for b in blocks):
            return None
        out["+".join(group)] = blocks
    logits = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    if isinstance(logits, BlockQuantized):
        out["logits"] = [logits]
    return out


def _float_params(tensors: dict) -> int:
    """Elements of every weight in the file: what a float path holds once dequantized."""
    return sum(int(torch.Size(t.shape).numel()) for t in tensors.values())


def _key(parts: dict[str, list], layers: int, dtypes: list[str]) -> str:
    shapes = ";".join(
        f"{n}:" + ",".join(f"{b.format.name}{b.shape[0]}x{b.shape[1]}" for b in bs) for n, bs in parts.items()
    )
    sources = [p.read_text() for p in sorted(native.CSRC.glob("*linear*"))]
    raw = "\0".join(
        [
            native.cpu_id(),
            torch.__version__,
            str(torch.get_num_threads()),
            str(VERSION),
            shapes,
            str(layers),
            ",".join(dtypes),
            *sources,
        ]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _store_path(key: str) -> Path:
    return store_dir() / f"gguf-weights-{key}.json"


def _read(path: Path) -> dict[str, dict[int, float]] | None:
    try:
        raw = json.loads(path.read_text())
        times = {c: {int(r): float(t) for r, t in by.items()} for c, by in raw["times"].items()}
        return times if "blocks" in times and all(set(by) == set(ROWS) for by in times.values()) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring the unreadable stored GGUF-weights times %s (%s); measuring again", path, e)
        return None


def _write(path: Path, times: dict[str, dict[int, float]]) -> None:
    write_json(path, {"cpu": native.cpu_id().split(" | ")[0], "times": times})
