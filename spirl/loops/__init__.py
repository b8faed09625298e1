"""Training loops, clients of spirl.core: GRPO (trainer.py: one step; run.py: the run simple_rl.py
starts; loss.py; evaluation.py; retokenization.py) and the supervised warm start (warmstart.py).
Never imports spirl.tinker (tests/test_layering.py)."""
