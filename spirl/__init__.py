"""SPIRL: bitwise-deterministic RL for Qwen3 (vLLM rollouts, a vLLM-compatible trainer, GRPO)."""
