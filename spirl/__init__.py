"""SPIRL: bitwise-deterministic RL for Qwen3 (vLLM rollouts, a vLLM-compatible trainer, GRPO, the Tinker API).

One core and its clients, one package each, imports one way (tests/test_layering.py):

    core/     the policy (weights, compute model, engine, weight sync, resume), LoRA, the optimizer, the
              bitwise parity check and its report, checkpoints, the memory plan, preflight checks,
              vLLM patches; rollouts of environments in token ids (multiturn, trajectory, chat_format)
    engines/  rollout engines: vLLM in batch-invariant mode, plain PyTorch (core and engines import
              each other: the policy builds an engine, the native engine scores with the core)
    tasks/    prompts as token ids and verifiable rewards; the calculator tool and environment
    loops/    GRPO (trainer: one step; run: simple_rl.py's run), evaluation, the supervised warm start
    tinker/   the Tinker API (sample / forward_backward / optim_step) on the core

loops/ and tinker/ are clients of the core and never import each other.
"""
