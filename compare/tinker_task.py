"""tinker-cookbook's own RL loop on a SPIRL task, through SPIRL's Tinker API.

    python -m spirl.tinker compare/tinker_task.py --model DIR --log-path runs/tinker-arith [--task arith] [--iterations 50]

A client of the API, not part of it: a single-turn task of spirl/tasks (arith: the same prompts,
reward and 500 held-out problems as `simple_rl.py --task arith`; synthetic; ...) as a cookbook `Env`
(one turn: the prompt ids, stop at <|im_end|>, reward = the task's), batches drawn like simple_rl.py
draws them (the same seed -> the same prompts), for a task with a held-out set an evaluator (greedy
accuracy, `eval/accuracy` in the cookbook's metrics), then `tinker_cookbook.rl.train.main` unmodified. Run it through
`python -m spirl.tinker` (it creates its clients with `tinker.ServiceClient()`, as the cookbook does).
Prints, per iteration, the parity counts SPIRL's backend logged (<SPIRL_TINKER_DIR>/<run>/parity.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import chz
import tinker
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (Action, Env, EnvGroupBuilder, Observation, RLDataset,
                                      RLDatasetBuilder, StepResult)

IM_END = "<|im_end|>"


def load_task(name: str, model_dir: str):
    from spirl.core.preflight import load_checked_tokenizer
    from spirl.tasks import get_task

    return get_task(name, load_checked_tokenizer(Path(model_dir)))


class TaskEnv(Env):
    """One problem, one turn: the prompt as token ids, the task's reward on the sampled ids."""

    def __init__(self, task, prompt_ids: list[int], meta: dict, stop: list[int]):
        self.task, self.prompt_ids, self.meta, self.stop = task, prompt_ids, meta, stop

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return tinker.ModelInput.from_ints(self.prompt_ids), self.stop

    async def step(self, action: Action, *, extra=None) -> StepResult:
        reward = self.task.reward(action, self.meta)
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.stop, metrics={"correct": float(reward >= 1.0)})


class TaskGroup(EnvGroupBuilder):
    def __init__(self, task, prompt_ids, meta, group_size: int, stop):
        self.task, self.prompt_ids, self.meta, self.group_size, self.stop = task, prompt_ids, meta, group_size, stop

    async def make_envs(self):
        return [TaskEnv(self.task, self.prompt_ids, self.meta, self.stop) for _ in range(self.group_size)]

    def logging_tags(self):
        return [self.task.name]


class TaskDataset(RLDataset):
    """Batch i: prompts_per_step problems drawn as simple_rl.py draws step i + 1's (spirl.loops.prompts.PromptSource)."""

    def __init__(self, task, batches: int, prompts_per_step: int, group_size: int, seed: int, stop):
        self.task, self.batches, self.n, self.g, self.seed, self.stop = task, batches, prompts_per_step, group_size, \
            seed, stop

    def get_batch(self, index: int):
        from spirl.loops.prompts import DataCursor, PromptSource

        source = PromptSource(self.task, self.seed, DataCursor(index * self.n))  # a dataset's position at step i + 1
        source.begin(index + 1)
        return [TaskGroup(self.task, ids, meta, self.g, self.stop) for ids, meta in source.draw(self.n)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class TaskDatasetBuilder(RLDatasetBuilder):
    task: str
    model_dir: str
    batches: int
    prompts_per_step: int = 32
    group_size: int = 8
    seed: int = 0

    async def __call__(self):
        task = load_task(self.task, self.model_dir)
        stop = [task.tokenizer.convert_tokens_to_ids(IM_END)]
        return TaskDataset(task, self.batches, self.prompts_per_step, self.group_size, self.seed, stop), None


class HeldOutAccuracy(SamplingClientEvaluator):
    """Greedy accuracy on the task's 500 held-out problems (what simple_rl.py's --eval-every logs)."""

    def __init__(self, task: str, model_dir: str, max_tokens: int):
        self.task, self.max_tokens = load_task(task, model_dir), max_tokens

    async def __call__(self, sampling_client) -> dict[str, float]:
        stop = [self.task.tokenizer.convert_tokens_to_ids(IM_END)]
        params = tinker.SamplingParams(max_tokens=self.max_tokens, temperature=0.0, stop=stop)
        problems = self.task.eval_problems()
        results = await asyncio.gather(*[sampling_client.sample_async(
            prompt=tinker.ModelInput.from_ints(ids), num_samples=1, sampling_params=params) for ids, _ in problems])
        correct = sum(self.task.reward(r.sequences[0].tokens, meta) >= 1.0 for r, (_, meta) in zip(results, problems))
        return {"eval/accuracy": correct / len(problems)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (e.g. the learning curve's sft model)")
    p.add_argument("--log-path", required=True, help="the cookbook's log directory (metrics.jsonl, checkpoints)")
    p.add_argument("--task", default="arith", help="a single-turn task of spirl/tasks (arith, synthetic, ...)")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--loss-fn", default="importance_sampling")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps-off-policy", type=int, default=None,
                   help="run the cookbook's async mode (AsyncConfig): sampling may run this many steps ahead of "
                        "training; off-policy batches are trained as given (uncompared). Default: synchronous")
    a = p.parse_args(argv)
    has_eval = hasattr(load_task(a.task, a.model), "eval_problems")
    evaluators = [lambda: HeldOutAccuracy(a.task, a.model, a.max_tokens)] if a.eval_every and has_eval else []
    cfg = train.Config(
        learning_rate=a.lr, model_name=a.model, recipe_name=f"spirl_{a.task}", max_tokens=a.max_tokens,
        log_path=a.log_path, dataset_builder=TaskDatasetBuilder(task=a.task, model_dir=a.model, batches=a.iterations,
                                                                 prompts_per_step=a.prompts_per_step,
                                                                 group_size=a.group_size, seed=a.seed),
        lora_rank=a.lora_rank, loss_fn=a.loss_fn, temperature=1.0, eval_every=a.eval_every,
        evaluator_builders=evaluators, save_every=0, wandb_project=None, num_groups_to_log=0,
        rollout_json_export=False,
        async_config=None if a.max_steps_off_policy is None else train.AsyncConfig(
            max_steps_off_policy=a.max_steps_off_policy, groups_per_batch=a.prompts_per_step, loss_fn=a.loss_fn))
    t0, started = time.perf_counter(), time.time()
    asyncio.run(train.main(cfg))
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (Path(a.log_path) / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    print(f"tinker_task: {len(rows)} metric rows, {wall:.1f} s in all; held-out accuracy "
          + ", ".join(f"step {s}: {100 * v:.1f}%" for s, v in evals))
    from spirl.tinker.backend import BackendConfig

    logs = [f for f in Path(BackendConfig.from_env().root).glob("*/parity.jsonl") if f.stat().st_mtime >= started - 1]
    calls = [json.loads(x) for f in logs for x in f.read_text().splitlines()]
    trained = [c for c in calls if c["backward"]]
    compared, different = sum(c["tokens_compared"] for c in trained), sum(c["tokens_different"] for c in trained)
    print(f"parity: {len(trained)} forward_backward calls, {compared} sampled tokens compared, {different} different; "
          f"fewest compared in a call: {min((c['tokens_compared'] for c in trained), default=0)}")
    # synchronous: every batch is on-policy, so every call compares; async: off-policy batches compare nothing
    compares = all if a.max_steps_off_policy is None else any
    return 0 if trained and different == 0 and compares(c["tokens_compared"] > 0 for c in trained) else 1


if __name__ == "__main__":
    sys.exit(main())
