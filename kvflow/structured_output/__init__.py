"""Structured outputs: constraints compiled to grammars (xgrammar), enforced token by token."""

from kvflow.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
