"""Issue 13 on CPU: the arith eval split, the evaluation, the carry-forgetting warm start, and the
whole learning-curve pipeline (tiny, native engine) end to end."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spirl.numerics.samples import Sample
from spirl.loops.evaluation import evaluate, require_eval_set
from spirl.tasks import arith

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from torchtitan_compat.tokenizer import load_tokenizer

    return load_tokenizer(tiny_ckpt)


@pytest.fixture(scope="module")
def task(tok):
    return arith.ArithTask(tok)


def digits(tok, n: int) -> list[int]:
    return [int(i) for i in tok(str(n), add_special_tokens=False)["input_ids"]] + [151645]


def test_eval_set_is_fixed_and_disjoint_from_training(task, tok):
    evals = {(m["a"], m["b"]) for _, m in task.eval_problems()}
    train = {(m["a"], m["b"]) for _, m in task.pool}
    assert len(evals) == arith.EVAL_SIZE and len(train) == 90 * 90 - arith.EVAL_SIZE
    assert not evals & train
    again = arith.ArithTask(tok)  # the split does not depend on anything but POOL_SEED
    assert [ids for ids, _ in again.eval_problems()] == [ids for ids, _ in task.eval_problems()]
    rng = random.Random(0)
    assert all((m["a"], m["b"]) in train for _, m in task.prompts(rng, 2000))


@pytest.mark.parametrize("a, b, forgot", [(58, 67, 15), (23, 45, 68), (99, 99, 88), (19, 91, 0), (50, 50, 0)])
def test_carry_free_sum(a, b, forgot):
    assert arith.carry_free_sum(a, b) == forgot


class ScriptedEngine:
    """Answers each prompt with ids chosen by a function of the prompt's problem."""

    def __init__(self, task, greedy_answer, sampled_answers):
        self.by_prompt = {tuple(ids): m for ids, m in task.eval_problems()}
        self.tok, self.greedy_answer, self.sampled_answers = task.tokenizer, greedy_answer, sampled_answers

    def greedy(self, prompts, max_tokens):
        return [digits(self.tok, self.greedy_answer(self.by_prompt[tuple(p)])) for p in prompts]

    def generate(self, prompts, n, max_tokens, temperature, seed, **sampling):
        out = []
        for p in prompts:
            answers = self.sampled_answers(self.by_prompt[tuple(p)])
            assert len(answers) == n
            out += [Sample(list(p), digits(self.tok, x), torch.empty(0)) for x in answers]
        return out


def test_evaluate_counts_greedy_accuracy_and_pass_at_k(task):
    cfg = SimpleNamespace(max_new_tokens=6, eval_pass_k=3, eval_size=0, temperature=1.0, min_p=0.0, top_k=-1,
                          top_p=1.0)
    # greedy: right exactly on the problems without a carry; samples: the right answer third
    engine = ScriptedEngine(task, lambda m: arith.carry_free_sum(m["a"], m["b"]),
                            lambda m: [m["answer"] + 1, m["answer"] + 2, m["answer"]])
    no_carry = sum(arith.carry_free_sum(m["a"], m["b"]) == m["answer"] for _, m in task.eval_problems())
    out = evaluate(engine, task, cfg)
    assert out["eval/accuracy"] == no_carry / arith.EVAL_SIZE and 0 < no_carry < arith.EVAL_SIZE
    assert out["eval/pass@3"] == 1.0
    engine.sampled_answers = lambda m: [m["answer"] + 1] * 3
    assert evaluate(engine, task, cfg)["eval/pass@3"] == 0.0


def test_eval_size_limits_the_evaluated_problems(task):
    """--eval-size 7: the first 7 held-out problems are answered (greedy and pass@k), and the scalars are of those."""
    cfg = SimpleNamespace(max_new_tokens=6, eval_pass_k=2, eval_size=7, temperature=1.0, min_p=0.0, top_k=-1,
                          top_p=1.0)
    engine = ScriptedEngine(task, lambda m: m["answer"], lambda m: [m["answer"]] * 2)
    asked = []
    greedy, generate = engine.greedy, engine.generate
    engine.greedy = lambda prompts, **kw: asked.append(("greedy", prompts)) or greedy(prompts, **kw)
    engine.generate = lambda prompts, **kw: asked.append(("sampled", prompts)) or generate(prompts, **kw)
    out = evaluate(engine, task, cfg)
    first = [ids for ids, _ in task.eval_problems()[:7]]
    assert asked == [("greedy", first), ("sampled", first)]
    assert out == {"eval/accuracy": 1.0, "eval/pass@2": 1.0}
    engine.greedy = lambda prompts, **kw: [[0]] * 6 + greedy(prompts[6:], **kw)  # wrong on 6 of the 7
    assert evaluate(engine, task, cfg)["eval/accuracy"] == 1 / 7


def test_eval_every_refused_for_a_task_without_eval_set():
    from spirl.core.config import ConfigError

    with pytest.raises(ConfigError, match="no held-out eval set"):
        require_eval_set(SimpleNamespace(name="synthetic"), SimpleNamespace(eval_every=5, task="synthetic"))
    require_eval_set(SimpleNamespace(), SimpleNamespace(eval_every=0, task="synthetic"))


def test_eval_size_larger_than_the_eval_set_is_refused(task):
    from spirl.core.config import ConfigError

    cfg = SimpleNamespace(eval_every=5, task="arith", eval_size=arith.EVAL_SIZE + 1)
    with pytest.raises(ConfigError, match=f"--eval-size {arith.EVAL_SIZE + 1}: task 'arith' has {arith.EVAL_SIZE} "):
        require_eval_set(task, cfg)
    require_eval_set(task, SimpleNamespace(eval_every=5, task="arith", eval_size=arith.EVAL_SIZE))


def test_native_greedy_is_the_argmax_of_the_trainer_forward(tiny_ckpt, task):
    from spirl.engines.native_engine import NativeEngine
    from weights_vllm_compat import load_model

    model = load_model(tiny_ckpt, device=torch.device("cpu"), dtype=torch.float32, backend="reference")
    engine = NativeEngine(model, (151645,))
    prompts = [ids for ids, _ in task.eval_problems()[:3]]
    got = engine.greedy(prompts, max_tokens=4)
    assert got == engine.greedy(prompts, max_tokens=4) and all(1 <= len(c) <= 4 for c in got)
    for p, c in zip(prompts, got):  # each token is the argmax after the prefix (full forward)
        for j, t in enumerate(c):
            ids = p + c[:j]
            with torch.no_grad():
                logits = model(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]))[-1]
            assert int(logits.argmax()) == t


@pytest.mark.parametrize("share, expect", [(0.0, "forgot"), (1.0, "right")])
def test_arith_warmstart_teacher(task, share, expect):
    from spirl.loops.warmstart import arith_example

    rng = random.Random(1)
    for _ in range(50):
        s = arith_example(task, rng, share)
        m = next(m for ids, m in task.pool if ids == s.prompt_ids)
        want = m["answer"] if expect == "right" else arith.carry_free_sum(m["a"], m["b"])
        assert s.completion_ids == digits(task.tokenizer, want)


@pytest.mark.slow
def test_learning_curve_pipeline_end_to_end_on_cpu(tmp_path):
    """The one-command pipeline (random model -> warm start -> GRPO with evals -> PNG), tiny and
    on CPU: every stage runs, evals are logged before the first step and after each, the PNG is
    written, parity is exact; with --off-policy-steps 0,1 a second run trains with K = 1 (its step 1 is the
    synchronous run's) and both are drawn on one figure. (Learning itself is shown on the GPU:
    docs/learning-curve.md.)"""
    out = tmp_path / "lc"
    cmd = [sys.executable, "-m", "compare.learning_curve", "--out", str(out), "--shape", "tiny", "--sft-steps", "3",
           "--sft-batch", "4", "--steps", "2", "--eval-every", "1", "--prompts-per-step", "2", "--group-size", "2",
           "--engine", "native", "--device", "cpu", "--min-gain", "0", "--off-policy-steps", "0,1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "runs" / "arith" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/accuracy" in r for r in rows)
    assert all(r["parity/tokens_different"] == 0 and r["parity/tokens_compared"] > 0 for r in rows[1:])
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens compared, 0 different; OK" in proc.stdout
    k1 = [json.loads(line) for line in (out / "runs" / "arith-offpolicy1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["offpolicy/staleness"] for r in k1[1:]] == [0, 1]
    same = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "offpolicy/"))}  # noqa: E731
    assert same(k1[1]) == same(rows[1])  # step 1 of K = 1 is the synchronous step 1
    assert all(r["parity/tokens_different"] == 0 for r in k1[1:])
    assert (out / "offpolicy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stdout.count("tokens compared, 0 different; OK") == 2
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "is not empty" in again.stderr
