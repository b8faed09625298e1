"""GRPO with bitwise rollout/trainer parity checked on every token of every step.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py                          # Qwen/Qwen3-1.7B, vLLM, GPU
    python simple_rl.py --engine native --model random:tiny --dtype float32 --task synthetic --steps 2  # CPU
    python simple_rl.py --help

Config: spirl/config.py. Run: spirl/run.py; step: spirl/trainer.py. Logs: runs/<run-name>/ (tensorboard --logdir runs).
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from spirl.config import parse_args

    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from spirl.checkpoint import CheckpointError
    from spirl.tasks import TaskError
    from spirl.run import ModelError, train

    try:
        train(cfg)
    except (ModelError, TaskError, CheckpointError) as e:  # setup problems: one line, no traceback
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
