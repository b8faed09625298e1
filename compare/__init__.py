"""Verification scripts: bitwise parity between vLLM and the trainer, and where it breaks."""
