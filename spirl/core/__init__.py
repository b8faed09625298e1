"""The core both clients train through (spirl.loops: GRPO; spirl.tinker: the Tinker API): the policy and
what sets a run up around it. Above spirl.engines (the policy builds its engine) and spirl.numerics.

build.py    build_policy_and_engine: the policy's one entry (full fine-tuning or LoRA)
spec.py     PolicySpec: what a policy is built from (each client makes its own)
policy.py   the policy: weights, the compute model, its engine, weight sync, resume
lora.py     LoRA: adapters merged into the engine's own tensors
optim.py    AdamW on fp32 masters, gradient clipping
objectives.py  per-token policy-gradient surrogates (PPO clip, CISPO, k3 KL) both clients' losses use
checkpoint.py, distributed.py, memory_plan.py, preflight.py, config.py, errors.py, metrics.py;
multiturn.py, chat_format.py (rollouts of environments in token ids). Imports itself, spirl.engines and
spirl.numerics only (tests/test_layering.py).
"""
