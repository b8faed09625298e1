"""GRPO with bitwise rollout/trainer parity checked on every token of every step.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py                          # Qwen/Qwen3-1.7B, vLLM, GPU
    python simple_rl.py --engine native --model random:tiny --dtype float32 --task synthetic --steps 2  # CPU
    python simple_rl.py --help

Config: spirl/core/config.py. Run: spirl/loops/run.py; step: spirl/loops/trainer.py. Logs: runs/<run-name>/ (tensorboard --logdir runs).
Progress is logged on stdout; stderr gets only the one line of an error (exit statuses: spirl/core/errors.py),
and a traceback only for a bug or with --debug 1 / SPIRL_DEBUG=1.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from spirl.core.config import parse_args
    from spirl.core.errors import set_debug

    cfg = parse_args(argv)
    if getattr(cfg, "debug", 0):
        set_debug(True)
    from spirl.core.errors import log_to_stdout

    log_to_stdout("%(asctime)s %(name)s %(levelname)s %(message)s")
    from spirl.loops.run import train

    train(cfg)
    return 0


if __name__ == "__main__":
    from spirl.core.errors import run_cli

    sys.exit(run_cli(main, debug_flag=False))
