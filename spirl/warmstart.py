"""Teach a checkpoint the calculator tool-call format: supervised steps on scripted episodes.

    python -m spirl.warmstart --model random:tiny --out checkpoints/models/calculator-tiny

Why it exists: a random-weight checkpoint (the only kind the tests and a machine without hub
access have) never writes a tool call and almost never closes a turn with <|im_end|>, so a
multi-turn run on it has one truncated turn per episode and no reward. A few hundred steps of
teacher-forced cross-entropy on scripted episodes (the same ids a real episode has: the template's
prompt, a canonical tool call, the tool reply from spirl.chat_format, an <answer>) teach a tiny
model the format, so that RL then has multi-turn episodes, rewards that differ within a group,
and peaked token distributions. A real Qwen3 checkpoint already knows the format: do not use this
on one. The loss covers only the policy's turns (the trajectory's loss mask).
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch

log = logging.getLogger("spirl.warmstart")


def scripted_episode(env, prompt_ids: list[int], meta: dict, rng: random.Random):
    """A correct two-turn calculator episode as a Trajectory (canonical encodings, zero logprobs)."""
    import json

    from .calculator import run_tool_call
    from .trajectory import Trajectory

    tok, fmt = env.tokenizer, env.format
    expr = meta["messages"][0]["content"].split("What is ", 1)[1].split("?", 1)[0]
    call = {"name": "calculator", "arguments": {"expression": expr}}
    enc = lambda text: [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]] + [fmt.turn_end_id]  # noqa: E731
    turn1 = enc(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    result = run_tool_call(call)
    turn2 = enc(f"<answer>{json.loads(result)['result']}</answer>")
    t = Trajectory.start(prompt_ids)
    t.add_turn(turn1, torch.zeros(len(turn1)))
    t.add_env(fmt.reply_ids(result), result)
    t.add_turn(turn2, torch.zeros(len(turn2)))
    return t


def warmstart(model_dir: Path, out: Path, steps: int, batch: int, lr: float, seed: int, device) -> list[float]:
    """Train on scripted calculator episodes; write the result to `out`. Returns the loss per step."""
    from torchtitan_compat.tokenizer import load_tokenizer
    from weights_vllm_compat import load_model

    from .parity import sampled_logprobs
    from .tasks.calculator import CalculatorEnv

    torch.manual_seed(seed)
    rng = random.Random(seed)
    env = CalculatorEnv(load_tokenizer(model_dir))
    model = load_model(model_dir, device=device, dtype=torch.float32, backend="reference")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        episodes = [scripted_episode(env, p, m, rng) for p, m in env.prompts(rng, batch)]
        lps = torch.cat(sampled_logprobs(model, episodes, device))
        loss = -lps.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step == 1 or step % 25 == 0 or step == steps:
            log.info("step %d/%d  loss %.3f  token p>0.5: %.2f  (%.0fs)", step, steps, losses[-1],
                     float((lps.detach() > -0.693).float().mean()), time.perf_counter() - t0)
    import weights
    import weights_vllm_compat

    hf_sd = weights_vllm_compat.compat_to_hf({k: v.detach() for k, v in model.state_dict().items()}, model.args)
    weights.save_hf_checkpoint(hf_sd, model_dir, out)
    log.info("wrote %s", out)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny", help="checkpoint to start from (dir, repo id or random:SHAPE)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the taught checkpoint to")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="scripted episodes per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where random:SHAPE checkpoints are written")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.lr <= 0:
        p.error("--steps and --batch must be >= 1 and --lr > 0")
    from .errors import log_to_stdout

    log_to_stdout()
    from .errors import require_writable_dir
    from .preflight import resolve_device, resolve_model, validate_model_dir

    require_writable_dir(args.out, "--out")
    device = resolve_device(args.device)
    model_dir = resolve_model(args.model, args.checkpoint_dir)
    validate_model_dir(model_dir)
    warmstart(model_dir, args.out, args.steps, args.batch, args.lr, args.seed, device)
    return 0


if __name__ == "__main__":
    from .errors import run_cli

    raise SystemExit(run_cli(main))
