"""kvflow: an LLM inference serving engine built around the KV cache."""

from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing kvflow (e.g. for `kvflow --help`) must not pull in torch.
    if name == "LLM":
        from kvflow.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvflow.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from kvflow.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
