"""TRL's GRPOTrainer on the same checkpoint, task and batch as simple_rl.py: the GRPO step a user would run instead.

    python compare/trl_grpo.py --model DIR [--task synthetic --prompts-per-step 8 --group-size 8
        --max-new-tokens 1024 --steps 5 --skip 2 --lora-rank 0] [--vllm colocate|none] [--out runs/trl_grpo]
    accelerate launch --num_processes 2 compare/trl_grpo.py ...   # 2 GPUs share --prompts-per-step (data parallel)
    python compare/trl_grpo.py --model DIR --vllm server --server-url URL [--trainer async --max-staleness 1]

`trl.GRPOTrainer` as its documentation sets it up, on the Qwen3 checkpoint directory that simple_rl.py
trains: prompts of a spirl task (its chat-template prompt ids, given to TRL as the text they decode to,
since TRL tokenizes prompts itself), the task's reward on the completion ids TRL passes to reward
functions, one optimizer step per batch of prompts x group samples (`generation_batch_size` = the batch,
`num_iterations=1`, no KL term: simple_rl.py's defaults), bf16 on a GPU, vLLM colocated on the same GPU
(`--vllm colocate`, `vllm_gpu_memory_utilization` as simple_rl's `--gpu-memory-utilization`) or
`model.generate` (`--vllm none`, the CPU check of this script). `--lora-rank R` trains LoRA (PEFT,
alpha 32, all linear layers) as `simple_rl.py --lora-rank R` does. Prints each step's wall clock
(a TrainerCallback), the median after `--skip` warm-up steps, and the peak torch memory, for
comparison with `simple_rl.py`'s `time/step` on the same arguments. TRL checks no sampler/trainer
parity: that is the difference the comparison prices.

With `--vllm server` the completions come from a vLLM server on GPUs of their own (compare/trl_server.py
starts one as `trl vllm-serve` does; `launch(..., layout="server" | "async")` runs both): `--trainer grpo`
is GRPOTrainer's server mode (synchronous: the trainer waits for each batch), `--trainer async` TRL's
AsyncGRPOTrainer (generation beside training, samples at most `--max-staleness` updates old; the
comparison for `simple_rl.py --off-policy-steps K --generation-gpus N`). AsyncGRPOTrainer takes its batches
from a queue outside the step, so its step is timed from one step's end to the next (the wall time a
user waits per optimizer step); GRPOTrainer's from the step's beginning to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def dataset_rows(task, steps: int, prompts_per_step: int, seed: int) -> list[dict]:
    """The prompts simple_rl.py draws for steps 1..steps (spirl.loops.prompts.PromptSource), as TRL rows."""
    from spirl.loops.prompts import DataCursor, PromptSource

    rows, source = [], PromptSource(task, seed, DataCursor())
    for step in range(1, steps + 1):
        source.begin(step)
        for ids, meta in source.draw(prompts_per_step):
            rows.append({"prompt": task.tokenizer.decode(ids), "meta": json.dumps(meta)})
    return rows


PASS_THROUGH_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""A chat template that renders the messages' text as it is (the prompt text is chat-templated already)."""


def as_conversations(rows: list[dict], tokenizer):
    """AsyncGRPOTrainer renders every prompt through the tokenizer's chat template: each row's prompt text (the
    task's chat-templated prompt, decoded) as one user message, and a copy of the tokenizer whose template renders
    it as it is, so the server gets the ids TRL's GRPOTrainer tokenizes from the same text. The copy keeps the
    response parser TRL sets for the tokenizer's own template (its rollout worker refuses a template it does not
    know unless one is set)."""
    import copy

    from trl.chat_template_utils import add_response_schema

    rendered = add_response_schema(copy.deepcopy(tokenizer))  # matched on the tokenizer's own template
    rendered.chat_template = PASS_THROUGH_TEMPLATE
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows], rendered


class TaskReward:
    """The task's reward on the completion ids TRL passes to reward functions; picklable (AsyncGRPOTrainer scores
    in a spawned process): pickled without the task, which the unpickled copy builds on first use from its name
    and the checkpoint's tokenizer. `task`: the task already built in this process, if any."""

    def __init__(self, task: str, model: str, built=None):
        self.task_name, self.model, self.task = task, model, built
        self.__name__ = f"{task}_reward"

    def __getstate__(self):
        return {**self.__dict__, "task": None}

    def __call__(self, prompts, completions, completion_ids, meta, **_):
        if self.task is None:
            from spirl.core.preflight import load_checked_tokenizer
            from spirl.tasks import get_task

            self.task = get_task(self.task_name, load_checked_tokenizer(Path(self.model)))
        return [self.task.reward(list(ids), json.loads(m)) for ids, m in zip(completion_ids, meta, strict=True)]


def trainer_args(a, batch: int, world: int, cuda: bool):
    """TRL's GRPOConfig (AsyncGRPOConfig with --trainer async) for the arguments `a` (one optimizer step per batch
    of `batch` samples over `world` processes), and PEFT's LoraConfig with --lora-rank (else None)."""
    common = dict(output_dir=a.out, max_steps=a.steps, learning_rate=a.lr, seed=a.seed, num_generations=a.group_size,
                  per_device_train_batch_size=a.micro_batch,
                  gradient_accumulation_steps=batch // (a.micro_batch * world), max_completion_length=a.max_new_tokens,
                  temperature=1.0, lr_scheduler_type="constant", bf16=cuda, gradient_checkpointing=cuda,
                  report_to="none", logging_steps=1, save_strategy="no")
    if a.trainer == "async":
        from trl.experimental.async_grpo import AsyncGRPOConfig

        config = AsyncGRPOConfig(**common, vllm_server_base_url=a.server_url, max_staleness=a.max_staleness)
    else:
        from trl import GRPOConfig

        config = GRPOConfig(
            **common, beta=0.0, num_iterations=1, generation_batch_size=batch, use_vllm=a.vllm != "none",
            vllm_mode="server" if a.vllm == "server" else "colocate", vllm_server_base_url=a.server_url,
            vllm_gpu_memory_utilization=a.gpu_memory_utilization, use_cpu=not cuda, dataloader_num_workers=0)
    if not a.lora_rank:
        return config, None
    from peft import LoraConfig

    return config, LoraConfig(r=a.lora_rank, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                              task_type="CAUSAL_LM")


ASYNC_NEEDS_HUB_KERNELS = (
    "AsyncGRPOTrainer left out: it computes attention with FlashAttention-3 fetched from the Hugging Face kernel hub "
    "(TRL's async_grpo/packing.py: kernels.get_kernel), and the kernels package is not installed "
    "(pip install kernels, on a machine that reaches the hub)")


def hub_kernels_installed() -> bool:
    """Whether Hugging Face's `kernels` package (the kernel hub client) is importable."""
    import importlib.util

    return importlib.util.find_spec("kernels") is not None


def launch(model: str, gpus: int, out: Path, *, prompts_per_step: int, group_size: int, max_new_tokens: int,
           steps: int, skip: int, extra: tuple[str, ...] = (), layout: str = "colocate", max_staleness: int = 1,
           server_port: int = 8000) -> tuple[float | None, str]:
    """This script as a user runs it on `gpus` processes (1: python; more: `accelerate launch`, data parallel, the
    prompts shared), plain vLLM (VLLM_BATCH_INVARIANT=0), the log in <out>.log. `layout`: "colocate" (vLLM in each
    process), "server" (GRPOTrainer) or "async" (AsyncGRPOTrainer, `max_staleness`) with a vLLM server on the GPU
    after the trainer's `gpus` (compare/trl_server.py; its log <out>-server.log; its context 1,024 tokens past
    the completions, at least 4,096: AsyncGRPOTrainer's micro-batch rows are that long by default). Returns (its
    median step in seconds, its summary line), or (None, the log's tail) if it failed, or (None, why) if
    AsyncGRPOTrainer cannot run here. `model`: a directory (TRL reads one)."""
    import shlex
    import subprocess
    from contextlib import nullcontext

    from compare import trl_server

    if layout == "async" and not hub_kernels_installed():
        return None, ASYNC_NEEDS_HUB_KERNELS

    launch = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", f"--num_processes={gpus}", "--num_machines=1",
        "--mixed_precision=bf16", "--dynamo_backend=no"]
    cmd = [*launch, str(Path(__file__).resolve()), "--model", model, "--prompts-per-step", str(prompts_per_step),
           "--group-size", str(group_size), "--max-new-tokens", str(max_new_tokens), "--steps", str(steps),
           "--skip", str(skip), "--out", str(out), *extra]
    log = out.with_suffix(".log")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "VLLM_BATCH_INVARIANT": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    server = nullcontext(None)
    if layout != "colocate":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
        serve_cmd = trl_server.command(model, server_port, 0.9, max(4096, max_new_tokens + 1024))
        server = trl_server.serve(serve_cmd, str(gpus), out.parent / f"{out.name}-server.log", server_port, env=env)
        cmd += ["--vllm", "server", "--server-url", f"http://127.0.0.1:{server_port}"]
        cmd += ["--trainer", "async", "--max-staleness", str(max_staleness)] if layout == "async" else []
    log.parent.mkdir(parents=True, exist_ok=True)
    with server:
        print(f"$ {shlex.join(cmd)}  (log {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=repo).returncode
    text = log.read_text()
    summary = [x for x in text.splitlines() if x.startswith("trl_grpo: ") and "median" in x]
    if rc or not summary:
        return None, f"exit {rc}, no summary:\n{text[-3000:]}"
    return float(summary[0].split("median ")[1].split(" s")[0]), summary[0]


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (weights.py --random ... makes one)")
    p.add_argument("--task", default="synthetic")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument("--vllm", default="colocate", choices=["colocate", "server", "none"])
    p.add_argument("--server-url", default=None, help="--vllm server: the vLLM server's URL (compare/trl_server.py)")
    p.add_argument("--trainer", default="grpo", choices=["grpo", "async"],
                   help="async: AsyncGRPOTrainer (needs --vllm server)")
    p.add_argument("--max-staleness", type=int, default=1, help="--trainer async: AsyncGRPOConfig.max_staleness")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (gradient accumulation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/trl_grpo")
    a = p.parse_args(argv)
    if (a.vllm == "server") != bool(a.server_url) or (a.trainer == "async" and a.vllm != "server"):
        p.error("--vllm server takes --server-url (and only it does); --trainer async needs --vllm server")
    return a


def step_clock(cuda: bool, between_ends: bool):
    """A TrainerCallback that prints and keeps each optimizer step's seconds: from its beginning to its end, or
    (`between_ends`) from the previous step's end (the first: from the start of training) to its end."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def _now(self):
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = self._now()

        def on_step_begin(self, args, state, control, **kw):
            if not between_ends:
                self.t0 = self._now()

        def on_step_end(self, args, state, control, **kw):
            now = self._now()
            self.times.append(now - self.t0)
            self.t0 = now
            print(f"trl_grpo: step {state.global_step} {self.times[-1]:.2f} s", flush=True)

    return StepClock()


def main(argv=None) -> int:
    a = _args(argv)
    batch = a.prompts_per_step * a.group_size
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under `accelerate launch --num_processes N`: N GPUs share the batch
    if batch % (a.micro_batch * world):
        raise SystemExit(f"error: --micro-batch {a.micro_batch} x {world} process(es) must divide prompts x group = {batch}")

    import torch
    from datasets import Dataset

    from spirl.core.preflight import load_checked_tokenizer
    from spirl.tasks import get_task

    task = get_task(a.task, load_checked_tokenizer(Path(a.model)))
    cuda = torch.cuda.is_available()
    if a.trainer == "async":
        from trl.experimental.async_grpo import AsyncGRPOTrainer as Trainer
    else:
        from trl import GRPOTrainer as Trainer
    config, peft_config = trainer_args(a, batch, world, cuda)
    rows, tokenizer = dataset_rows(task, a.steps, a.prompts_per_step, a.seed), task.tokenizer
    if a.trainer == "async":
        rows, tokenizer = as_conversations(rows, tokenizer)
    clock = step_clock(cuda, between_ends=a.trainer == "async")
    trainer = Trainer(model=a.model, reward_funcs=TaskReward(a.task, a.model, task), args=config,
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=peft_config,
                      callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    measured = clock.times[a.skip:] or clock.times
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    what = f"{'LoRA rank %d' % a.lora_rank if a.lora_rank else 'full fine-tuning'}, vLLM {a.vllm}"
    what += f", AsyncGRPOTrainer max_staleness {a.max_staleness}" if a.trainer == "async" else ""
    print(f"trl_grpo: {len(clock.times)} steps of {a.prompts_per_step} x {a.group_size} samples x {a.max_new_tokens} "
          f"new tokens ({what}): median {statistics.median(measured):.2f} s a step (steps "
          f"{len(clock.times) - len(measured) + 1}-{len(clock.times)}), peak torch memory {peak:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
