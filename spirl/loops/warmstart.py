"""Supervised warm start: teach a checkpoint a task's answer format (and part of its skill).

    python -m spirl.loops.warmstart --task calculator --model random:tiny --out checkpoints/models/calculator-tiny
    python -m spirl.loops.warmstart --task arith --model DIR --out DIR2 --steps 1500 --correct-share 0.3

Why it exists: a random-weight checkpoint (the only kind the tests and a machine without hub
access have) never writes a tool call or a number and almost never closes a turn with
<|im_end|>, so RL on it has no reward. Teacher-forced cross-entropy on scripted answers (the same
ids a real episode has) teaches a small model the format, so that RL then has rewards that differ
within a group. A real Qwen3 checkpoint already knows the format: do not use this on one.

Tasks:
  calculator  two-turn episodes: a canonical tool call, the tool reply, an <answer> (the loss
              covers only the policy's turns, the trajectory's loss mask).
  arith       "What is a+b?" answered by a *teacher that forgets carries*: with probability
              --correct-share the true sum, else the carry-free sum (each digit (a_i+b_i) mod 10,
              e.g. 58+67 -> 15). Problems without a carry get the right answer either way; on the
              ~3/4 with a carry the model learns to prefer the wrong answer but keeps the right one
              in its distribution. GRPO with the verifier's reward must then find and reinforce it:
              the held-out accuracy has room to rise (docs/learning-curve.md). Only training pairs
              are used (spirl.tasks.arith keeps the eval pairs out of its pool).

The steps run on the trainer's own path (spirl.core.policy.build_policy: fp32 masters, the compute
model's forward and deterministic backward, per-layer AdamW), so a warm start is as repeatable
as a GRPO step: same seed, same bits.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch

log = logging.getLogger("spirl.loops.warmstart")

TASKS = ("calculator", "arith")
WARMUP_STEPS = 50
"""The learning rate rises linearly to --lr over the first WARMUP_STEPS steps (over the first
tenth of a run shorter than 10 x WARMUP_STEPS)."""
TURN_END = "<|im_end|>"
"""A scripted answer ends its turn the way Qwen3's chat template does (its id read from the tokenizer,
as spirl.core.chat_format does)."""


def scripted_episode(env, prompt_ids: list[int], meta: dict, rng: random.Random):
    """A correct two-turn calculator episode as a Trajectory (canonical encodings, zero logprobs)."""
    import json

    from ..tasks.calculator_tool import run_tool_call
    from ..numerics.trajectory import Trajectory

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


def arith_example(task, rng: random.Random, correct_share: float):
    """A training problem of spirl.tasks.arith answered by the carry-forgetting teacher, as a Sample."""
    from ..numerics.samples import Sample
    from ..tasks.arith import carry_free_sum

    prompt, meta = task.prompts(rng, 1)[0]
    answer = meta["answer"] if rng.random() < correct_share else carry_free_sum(meta["a"], meta["b"])
    ids = [int(i) for i in task.tokenizer(str(answer), add_special_tokens=False)["input_ids"]]
    return Sample(prompt, ids + [task.tokenizer.convert_tokens_to_ids(TURN_END)], torch.empty(0))


def example_maker(task_name: str, model_dir: Path, correct_share: float):
    """(rng -> one scripted trainable sequence) for the task."""
    from torchtitan_compat.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if task_name == "arith":
        from ..tasks.arith import ArithTask

        task = ArithTask(tok)
        return lambda rng: arith_example(task, rng, correct_share)
    from ..tasks.calculator import CalculatorEnv

    env = CalculatorEnv(tok)
    return lambda rng: scripted_episode(env, *env.prompts(rng, 1)[0], rng)


def warmstart(model_dir: Path, out: Path, steps: int, batch: int, lr: float, seed: int, device,
              task: str = "calculator", correct_share: float = 1.0) -> list[float]:
    """Supervised steps on scripted answers; write the result to `out`. Returns the loss per step."""
    import weights
    import weights_vllm_compat

    from ..core.policy import build_policy
    from ..core.spec import EngineSpec, PolicySpec
    from ..numerics.parity import sampled_logprobs

    torch.manual_seed(seed)
    rng = random.Random(seed)
    make = example_maker(task, model_dir, correct_share)
    on_gpu = device.type == "cuda"
    spec = PolicySpec(model=str(model_dir), engine=EngineSpec(kind="vllm" if on_gpu else "native"),
                      dtype="bfloat16" if on_gpu else "float32", lr=lr, activation_checkpointing=False)
    policy = build_policy(weights.read_model_dir(model_dir), spec, device)
    losses, t0 = [], time.perf_counter()
    warmup = max(1, min(WARMUP_STEPS, steps // 10))
    for step in range(1, steps + 1):
        for group in policy.optimizer.param_groups:  # linear warm-up: no early blow-up at a high lr
            group["lr"] = lr * min(1.0, step / warmup)
        examples = [make(rng) for _ in range(batch)]
        lps = torch.cat(sampled_logprobs(policy.model, examples, device)).float()
        loss = -lps.mean()
        if not torch.isfinite(loss):
            raise RuntimeError(f"warm start step {step}: loss is {float(loss)}; lower --lr")
        loss.backward()
        policy.grads_to_masters()
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.push_masters_to_model()
        losses.append(float(loss.detach()))
        if step == 1 or step % 100 == 0 or step == steps:
            log.info("warm start step %d/%d  loss %.3f  token p>0.5: %.2f  (%.0fs)", step, steps, losses[-1],
                     float((lps.detach() > -0.693).float().mean()), time.perf_counter() - t0)
    # the fp32 masters (not their bf16 cast): RL then starts from exactly what was learned
    sd = {k: policy.masters.get(k, v).detach() for k, v in policy.model.state_dict().items()}
    hf_sd = weights_vllm_compat.compat_to_hf(sd, policy.model.args)
    weights.save_hf_checkpoint(hf_sd, model_dir, out)
    log.info("wrote %s", out)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny", help="checkpoint to start from (dir, repo id or random:SHAPE)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the taught checkpoint to")
    p.add_argument("--task", choices=TASKS, default="calculator", help="what to teach (see above)")
    p.add_argument("--correct-share", type=float, default=1.0,
                   help="arith: share of scripted answers that are the true sum (the rest forget carries)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="scripted episodes per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where random:SHAPE checkpoints are written")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.lr <= 0 or not 0 <= args.correct_share <= 1:
        p.error("--steps and --batch must be >= 1, --lr > 0 and --correct-share in [0, 1]")
    from ..core.errors import log_to_stdout

    log_to_stdout()
    from ..core.errors import require_writable_dir
    from ..core.preflight import resolve_device, resolve_model, validate_model_dir

    require_writable_dir(args.out, "--out")
    device = resolve_device(args.device)
    model_dir = resolve_model(args.model, args.checkpoint_dir)
    validate_model_dir(model_dir)
    warmstart(model_dir, args.out, args.steps, args.batch, args.lr, args.seed, device, args.task, args.correct_share)
    return 0


if __name__ == "__main__":
    from ..core.errors import run_cli

    raise SystemExit(run_cli(main))
