"""All configuration in one typed place, validated at start-up. It sits at the bottom of the
package map: nothing here imports the rest of kvflow (the packages that implement a named choice
import its names from here).

- `EngineConfig` (engine.py): what the user chooses; every field an `LLM(...)` keyword and a flag.
- `ServerConfig` (server.py): the options of `kvflow serve` beyond the engine's.
- `ModelConfig` (model.py): what the checkpoint dictates.
- `SpeculativeConfig`, `KVTransferConfig`: the typed forms of the engine's JSON-object options.
- `option` (options.py): how a field declares its help and accepted values, once.
"""

from kvflow.config.engine import (
    ATTENTION_BACKENDS,
    DTYPES,
    FAIRNESS_MODES,
    FLOAT_KV_CACHE_DTYPES,
    GGUF_WEIGHTS,
    KERNEL_AUTOTUNE_MODES,
    KV_CACHE_DTYPES,
    QUANTIZED_KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.config.model import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig, MoeConfig, RopeConfig
from kvflow.config.server import ROUTER_POLICIES, TOOL_CALL_PARSERS, ServerConfig
from kvflow.config.speculative import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "FAIRNESS_MODES",
    "FLOAT_KV_CACHE_DTYPES",
    "GGUF_WEIGHTS",
    "KERNEL_AUTOTUNE_MODES",
    "KV_CACHE_DTYPES",
    "MOE_ARCHITECTURES",
    "QUANTIZED_KV_CACHE_DTYPES",
    "ROUTER_POLICIES",
    "SCHEDULING_POLICIES",
    "SUPPORTED_ARCHITECTURES",
    "TOOL_CALL_PARSERS",
    "EngineConfig",
    "KVTransferConfig",
    "ModelConfig",
    "MoeConfig",
    "RopeConfig",
    "ServerConfig",
    "SpeculativeConfig",
]
