"""SPIRL: bitwise-deterministic RL for Qwen3 (vLLM rollouts, a vLLM-compatible trainer, GRPO, the Tinker API).

One package per layer, imports one way (lowest first; tests/test_layering.py checks it, and that no
module of the tree imports in a circle):

    numerics/ what the engines and the trainer share and must agree on bit for bit: samples and
              trajectories in token ids, the sampling distributions, the logprob and parity kernels
              and the parity report, the first diverging op (localize), the vLLM patches
    engines/  rollout engines: vLLM in batch-invariant mode, plain PyTorch (they import numerics/)
    core/     the policy (weights, compute model, optimizer, LoRA, its engine, weight sync, resume:
              build.py is its one entry) and what sets a run up around it: checkpoints, the memory plan,
              preflight checks, the config, errors, metrics; the episode loop of environments in token
              ids (multiturn, chat_format)
    tasks/    prompts as token ids and verifiable rewards; the calculator tool and environment; datasets
              (--dataset), reasoning-gym, TRL-signature reward functions, math-verify
    loops/    GRPO (setup: a run's set-up into a Run; run: its loop, checkpoints and signals; trainer: one
              step; rollout and prompts: its samples, parity, rewards, dynamic sampling; update: one optimizer
              update; loss: the loss menu), evaluation, the supervised warm start
    tinker/   the Tinker API (sample / forward_backward / optim_step) on the core

loops/ and tinker/ are clients of the core and never import each other.
"""
