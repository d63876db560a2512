"""Every `EngineConfig` field as a `--dashed-flag`, so the CLI and `LLM(...)` never drift apart.
`add_dataclass_args` does the same for any config dataclass (e.g. `ServerConfig`); `dataclass_flags`
goes back from parsed flags to a command line (the replicas of `kvflow serve --data-parallel-size`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from kvflow.config import EngineConfig

_HELP = {
    "model": "HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "weight and KV dtype: float32, bfloat16, float16",
    "device": "torch device, e.g. cpu or cuda",
    "max_model_len": "longest prompt + output in tokens (default: the model's context length)",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool size in blocks (overrides --kv-cache-memory-gb)",
    "kv_cache_memory_gb": "memory for the KV pool in GiB",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks + decodes)",
    "max_num_seqs": "most sequences running at once",
    "seed": "seed of the engine's shared random generator",
    "tokenizer": "tokenizer folder (default: the model's own)",
    "enable_prefix_caching": "share the KV of common prompt prefixes between requests",
    "quantization": "weight quantization: int8 (W8A8, per-channel weights, per-token activations, FBGEMM), "
                    "int4 (4-bit blocks of 32 with scale and offset, GGML's Q4_1, rounded at load; block kernels) "
                    "or none",
    "gguf_weights": "a GGUF's quantized tensors: native (run as stored by the block kernels, where they run: "
                    "CPU, float32, one rank) or dequantize (float32 at load, exact HF equivalence)",
    "kv_cache_dtype": "KV cache dtype: auto (= --dtype) or int8",
    "attention_backend": "attention: native (C kernel, CPU float32), triton (Triton kernels, CUDA), torch "
                         "(gather + SDPA, any device), or auto (triton on CUDA, native on the CPU)",
    "enforce_eager": "CUDA: run decode steps eagerly instead of replaying CUDA graphs",
    "cuda_graph_sizes": "CUDA: decode batch sizes to capture graphs for, comma-separated (default: 1,2,4 and "
                        "multiples of 8 up to min(max_num_seqs, 256))",
    "kernel_autotune": "on: time the linear kernel paths on this CPU at the first start and cache the "
                       "choice (a few seconds, once); off: the documented default choice",
    "kv_offload_cpu_gb": "CPU-memory tier for evicted prefix-cache blocks, GiB (0 = off)",
    "kv_offload_disk_dir": "directory of the disk tier for evicted prefix-cache blocks (kept across runs)",
    "kv_offload_disk_gb": "size limit of the disk tier, GiB",
    "speculative_config": "speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}' (keys: method, num_speculative_tokens, "
                          "prompt_lookup_min, prompt_lookup_max, adaptive)",
    "tensor_parallel_size": "split every layer over this many ranks (worker processes on this machine, "
                            "all-reduce over shared memory or gloo, whichever measures faster)",
    "distributed_executor_backend": "uni (one rank), mp (a process per rank, default for TP > 1) or ray (Ray "
                                    "actors in a placement group; RAY_ADDRESS joins a cluster)",
    "cpu_threads_per_rank": "torch threads (and pinned CPUs) per tensor-parallel rank (default: the CPUs "
                            "split evenly)",
    "kv_transfer_config": "prefill/decode disaggregation as a JSON object, e.g. '{\"kv_connector\": \"tcp\", "
                          "\"kv_role\": \"kv_producer\"}' (keys: kv_connector tcp|shm, kv_role "
                          "kv_producer|kv_consumer|kv_both, kv_ip, kv_port, kv_lease_s, kv_transfer_timeout_s, "
                          "kv_load_failure_policy recompute|fail, engine_id)",
}


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_dataclass_args(parser, EngineConfig, "engine options", _HELP, exclude)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str,
                       help: dict[str, str] | None = None, exclude: tuple[str, ...] = ()) -> None:
    """One `--dashed-flag` per field of the dataclass `cls`, typed from its annotations
    (fields in `exclude` keep their defaults: the command uses those flags for something else)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    help = help or {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name in exclude:
            continue
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f"{help.get(f.name, f.name.replace('_', ' '))} (default: {default})"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=text)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, dest=f.name, type=_comma_list, default=default, help=text)
        elif typing.get_origin(kind) is dict:
            group.add_argument(flag, dest=f.name, type=_json_object, default=default, help=text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=default, help=text)


def dataclass_kwargs(cls: type, args: argparse.Namespace) -> dict[str, typing.Any]:
    """The dataclass fields that `args` carries (flags excluded at registration are left out)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if not f.name.startswith("_") and hasattr(args, f.name)}


def dataclass_from_args(cls: type, args: argparse.Namespace):
    return cls(**dataclass_kwargs(cls, args))


def dataclass_flags(cls: type, args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> list[str]:
    """The `--flags` that give another `kvflow` command the same fields of `cls` as `args` holds:
    every field whose value differs from the flag's default (those in `exclude`, or absent from
    `args`, left out), in the syntax `add_dataclass_args` parses."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name in exclude or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value is None or value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        if kind is bool:
            out.append(flag if value else "--no-" + flag[2:])
        elif typing.get_origin(kind) is list:
            out += [flag, ",".join(str(x) for x in value)]
        elif typing.get_origin(kind) is dict:
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return obj


def _comma_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _base_type(hint: typing.Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return dataclass_from_args(EngineConfig, args)
