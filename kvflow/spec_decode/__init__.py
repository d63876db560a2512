"""Speculative decoding: proposers of draft tokens and their configuration. The target model
verifies the drafts with `kvflow.sample.rejection_sampler.RejectionSampler`."""

from kvflow.config import SpeculativeConfig
from kvflow.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
