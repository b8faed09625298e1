"""SPIRL's tools beside the trainer: parity checks between vLLM and the trainer (and where they break), benchmarks
against what a user would run instead (plain vLLM, torchtitan, TRL), the experiment runner and learning curves, and
profilers. Each tool runs as `python -m compare.NAME` from the repository root, or `python compare/NAME.py` once the
project is installed (`pip install -e .`); compare/README.md indexes them."""
