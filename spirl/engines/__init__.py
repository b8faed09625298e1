"""Rollout engines: each turns prompts (token ids) into sampled completions with their logprobs."""

from .base import Sample, samples_by_prompt

__all__ = ["Sample", "samples_by_prompt"]
