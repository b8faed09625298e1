"""What the rollout engines and the trainer share, below both: the numbers they must agree on bit for bit.

samples.py       Sample (what engines return, what the trainer trains on) and its grouping
trajectory.py    multi-turn trajectories in token ids (a trainable sequence with a loss mask)
parity.py        the sampling distributions, the trainer's logprob kernels (packed forward), the bitwise
                 sampler-trainer check and its report
localize.py      the first diverging layer/op of a parity failure (--localize)
vllm_patches.py  the one vLLM behaviour patched so that the engine computes what the trainer computes

Imports only itself (and the layers below spirl): engines import it, never the other way
(tests/test_layering.py).
"""
