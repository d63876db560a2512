"""A W4A16 checkpoint (compressed-tensors `pack-quantized`, as llm-compressor writes it) against the
same model's bfloat16 path: weights held and batch-1 decode tok/s, on a model larger than the
last-level cache.

    python benchmarks/quantized_checkpoints.py [--hidden 2048] [--layers 16] [--group 128]
        [--new-tokens 32] [--rounds 3]

A random-initialised Llama of Llama-3.2-1B's shape (hidden 2048, FFN 8192, 32 / 8 heads, 16
layers, vocabulary 32000 here to keep the embedding small) saved as a bfloat16 HF folder; its
projections packed to 4-bit symmetric groups of --group by compressed-tensors' own compressor
into a second folder (embeddings, norms and lm_head stay bfloat16). Each engine decodes
--new-tokens tokens greedily from a 16-token prompt at batch 1; the two run in interleaved rounds
and the median decode tok/s (first token excluded) is reported with the ratio. Figures:
docs/benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def make_models(root: Path, hidden: int, layers: int, group: int) -> tuple[str, str]:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    bf16 = root / "bf16"
    model.save_pretrained(bf16)
    del model

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = {}
    for f in sorted(bf16.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if not name.endswith("_proj.weight"):
                tensors[name] = t
                continue
            w = t.float()
            blocks = w.reshape(w.shape[0], -1, group)
            scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
            packed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
            packed["weight_scale"] = packed["weight_scale"].to(torch.bfloat16)
            tensors.update({f"{name[: -len('.weight')]}.{k}": v for k, v in packed.items()})
    w4 = root / "w4a16"
    w4.mkdir()
    conf = json.loads((bf16 / "config.json").read_text())
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        quant_method="compressed-tensors",
        format="pack-quantized",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    qc["quantization_status"] = "compressed"
    conf["quantization_config"] = qc
    (w4 / "config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(w4 / "model.safetensors"))
    return str(bf16), str(w4)


def decode_rate(llm, new_tokens: int) -> float:
    from kvflow import SamplingParams

    prompt = list(range(100, 116))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], full, use_tqdm=False)
    return (new_tokens - 1) / (time.perf_counter() - t0 - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from kvflow import LLM

    with tempfile.TemporaryDirectory(prefix="kvflow-quant-bench-") as tmp:
        bf16, w4 = make_models(Path(tmp), a.hidden, a.layers, a.group)
        engines = {
            "bf16": LLM(bf16, dtype="bfloat16", max_model_len=256, num_kv_blocks=64),
            "W4A16": LLM(w4, max_model_len=256, num_kv_blocks=64),
        }
        held = {name: sum(lin.kernel.nbytes for lin in _projections(llm)) for name, llm in engines.items()}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(a.rounds):
            for name, llm in engines.items():
                rates[name].append(decode_rate(llm, a.new_tokens))
    print(f"model: hidden {a.hidden}, {a.layers} layers, FFN {4 * a.hidden}; W4A16 symmetric groups of {a.group}")
    print(f"{'path':8} {'projection MB':>14} {'batch-1 decode tok/s':>21}  rounds")
    for name in engines:
        med = statistics.median(rates[name])
        print(f"{name:8} {held[name] / 1e6:14.1f} {med:21.2f}  {', '.join(f'{r:.2f}' for r in rates[name])}")
    ratio = statistics.median(rates["W4A16"]) / statistics.median(rates["bf16"])
    print(f"W4A16 / bf16 batch-1 decode: {ratio:.2f}x")


def _projections(llm):
    model = llm.engine.runner.model
    for layer in model.layers:
        yield from (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)


if __name__ == "__main__":
    main()
