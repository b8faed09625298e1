"""The core both clients train through (spirl.loops: GRPO; spirl.tinker: the Tinker API).

policy.py   weights, the compute model, the engine, weight sync, resume
lora.py     LoRA: adapters merged into the engine's own tensors
optim.py    AdamW on fp32 masters, gradient clipping
parity.py   the bitwise sampler-trainer check and its report
checkpoint.py, memory_plan.py, preflight.py, distributed.py, config.py, errors.py, metrics.py,
localize.py, vllm_patches.py; multiturn.py, trajectory.py, chat_format.py (rollouts of environments
in token ids). Imports only itself and spirl.engines (tests/test_layering.py).
"""
