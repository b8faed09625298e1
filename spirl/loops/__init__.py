"""Training loops, clients of spirl.core: GRPO (trainer.py: one step; rollout.py: its prompts, samples,
parity, rewards and dynamic sampling; loss.py: advantages and the loss menu; run.py: the run simple_rl.py
starts; evaluation.py; retokenization.py; timing.py) and the supervised warm start (warmstart.py).
Never imports spirl.tinker (tests/test_layering.py)."""
