"""SPIRL: bitwise-deterministic RL for Qwen3 (vLLM rollouts, a vLLM-compatible trainer, GRPO, the Tinker API).

One core, its clients, imports one way (tests/test_layering.py):

    core      policy.py (weights, compute model, engine, weight sync, resume), lora.py (LoRA: adapters
              merged into the engine's own tensors), optim.py, parity.py (the bitwise check and its
              report), checkpoint.py, memory_plan.py, preflight.py, distributed.py, config.py,
              errors.py, metrics.py, localize.py, vllm_patches.py; multiturn.py, trajectory.py,
              chat_format.py (rollouts of environments in token ids)
    engines   engines/ (vLLM in batch-invariant mode, plain PyTorch)
    tasks     tasks/, calculator.py (prompts as token ids and verifiable rewards)
    loops     trainer.py (one GRPO step), run.py (the run: simple_rl.py), evaluation.py, loss.py,
              retokenization.py, warmstart.py (supervised)
    api       tinker/ (Tinker's sample / forward_backward / optim_step on the core)

The loops and the API are clients of the core and never import each other.
"""
