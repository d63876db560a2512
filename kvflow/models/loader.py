"""Finding and reading checkpoints: a HF folder (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.config import EngineConfig, ModelConfig

logger = logging.getLogger("kvflow")


@dataclass
class Checkpoint:
    path: str
    name: str
    hf_config: dict[str, Any]
    model_config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]]
    tokenizer: Any | None  # a transformers tokenizer, or None when the folder has none
    generation_config: dict[str, Any]
    block_quantized: bool = False  # some tensors stay in GGUF block formats (`keep_blocks`)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from kvflow.models.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (give a HF model folder with config.json and "
            f"*.safetensors, or a .gguf file; kvflow never downloads from a hub)"
        )
    return str(path)


def load_checkpoint(
    model: str | None, tokenizer: str | None = None, with_tokenizer: bool = True, keep_blocks: bool = False
) -> Checkpoint:
    """`with_tokenizer=False`: weights and configuration only (a tensor-parallel worker).
    `keep_blocks`: a GGUF's quantized tensors stay in their block formats (see `gguf_block_weights`)."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from kvflow.models.gguf_loader import load_gguf
        from kvflow.quantization.gguf_blocks import BlockQuantized

        g = load_gguf(path, with_tokenizer, keep_blocks)
        # The file's own name ("SmolLM2-135M-Instruct.Q4_1"), not general.name: it is what users
        # typed and what the server reports as the model id.
        return Checkpoint(
            path=path,
            name=Path(path).stem,
            hf_config=g.hf_config,
            model_config=ModelConfig.from_hf_config(g.hf_config),
            weights=iter(g.tensors.items()),
            tokenizer=g.tokenizer,
            generation_config={},
            block_quantized=any(isinstance(t, BlockQuantized) for t in g.tensors.values()),
        )
    return _load_hf_folder(Path(path), tokenizer, with_tokenizer)


def gguf_block_weights(config: EngineConfig) -> bool:
    """Whether this engine runs a GGUF's quantized tensors as they are stored (`gguf_weights="native"`,
    the default, where the block kernels run) or dequantizes them to float at load; says why when
    it cannot keep them."""
    path = resolve_model_path(config.model)
    if not path.endswith(".gguf") or config.gguf_weights != "native":
        return False
    reason = why_no_block_kernels(config)
    if reason is not None:
        logger.info("GGUF weights dequantized to float at load: %s", reason)
        return False
    return True


def why_no_block_kernels(config: EngineConfig) -> str | None:
    """Why a GGUF's blocks cannot run as stored under `config` (None: they can)."""
    if config.device != "cpu" or config.dtype != "float32":
        return f"the block kernels run on the CPU in float32 (device={config.device}, dtype={config.dtype})"
    if config.quantization is not None:
        return f"quantization={config.quantization!r} re-quantizes the float weights"
    if config.tensor_parallel_size > 1:
        return "tensor parallelism shards float weights"
    from kvflow.kernels.cpu.block_linear import block_kernels_unavailable

    return block_kernels_unavailable()


def _load_hf_folder(path: Path, tokenizer_path: str | None, with_tokenizer: bool = True) -> Checkpoint:
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is neither a folder nor a .gguf file")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{str(config_file)!r} not found: a HF model folder needs config.json")
    hf_config = json.loads(config_file.read_text())
    model_config = ModelConfig.from_hf_config(hf_config)  # refuse unsupported models before reading weights
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    weights = _safetensors_weights(path)
    if hf_config.get("quantization_config"):
        # GPTQ / AWQ / compressed-tensors: refused here (before reading weights) if unsupported;
        # otherwise the packed tensors reach the model in the kernels' formats.
        from kvflow.models.quantized_loader import quantized_weights
        from kvflow.quantization.checkpoint_formats import parse_quantization_config

        quant = parse_quantization_config(hf_config["quantization_config"])
        if model_config.is_moe or hf_config.get("model_type") in ("phi3", "glm4", "ernie4_5", "cohere", "cohere2"):
            raise ValueError(
                f"{quant.label} checkpoints of {hf_config.get('model_type')!r} models are not supported yet "
                "(quantized HF checkpoints run for dense models with separate q/k/v and gate/up projections)"
            )
        weights = quantized_weights(weights, quant)
    return Checkpoint(
        path=str(path),
        name=path.name,
        hf_config=hf_config,
        model_config=model_config,
        weights=weights,
        tokenizer=_load_tokenizer(Path(tokenizer_path) if tokenizer_path else path) if with_tokenizer else None,
        generation_config=generation_config,
    )


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}")
    missing = [f for f in files if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"weight shard(s) {missing} listed in the index are missing from {str(path)!r}")

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(path / f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, fh.get_tensor(name)

    return gen()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: Path) -> Any | None:
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: prompts must be token ids and outputs have no text", path)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_hf_model(model: str | None, dtype: torch.dtype = torch.float32):
    """The same checkpoint through HF transformers (the baseline in benchmarks and tests)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        p = Path(path)
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
