"""Rollout engines: each turns prompts (token ids) into sampled completions with their logprobs
(spirl.numerics.samples.Sample). Above spirl.numerics, below spirl.core, which builds them."""
