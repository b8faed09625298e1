"""GRPO trainer on the CPU: loss/advantage values by hand, 2 native-engine steps with every
TensorBoard scalar, exact resume, one-line config errors."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spirl.core.config import TrainConfig
from spirl.loops.loss import grpo_advantages, grpo_loss

REPO = Path(__file__).resolve().parents[1]
LN2 = math.log(2.0)


# -- advantages and loss, by hand -------------------------------------------------------------


def test_grpo_advantages_hand_computed():
    # group 1: rewards 1,0,0,0 -> mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330127
    #   A = 0.75 / 0.4330127 = 1.7320508, -0.25 / 0.4330127 = -0.5773503 (eps 1e-6 is negligible)
    # group 2: equal rewards -> std 0 -> A = 0 / (0 + eps) = 0 exactly (no NaN)
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2]), group_size=4)
    expected = torch.tensor([1.7320508, -0.5773503, -0.5773503, -0.5773503, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_grpo_advantages_rejects_ragged():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(5), group_size=4)


def _loss_inputs():
    # 2 sequences, L = 2; sequence 1 has one real token (position 1 is padding, with junk values)
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(1.5), math.log(0.5)], [0.0, 5.0]], requires_grad=True)
    ref = lp.detach() + torch.tensor([[LN2, 0.0], [-LN2, 7.0]])  # ref - lp = delta per token
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    entropy = torch.tensor([[1.0, 3.0], [2.0, 100.0]])
    return lp, old, ref, adv, mask, entropy


def test_grpo_loss_hand_computed():
    lp, old, ref, adv, mask, entropy = _loss_inputs()
    loss, m = grpo_loss(lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    # ratios: seq 0 -> 1.5, 0.5 ; seq 1 -> 1.0
    # seq 0 (A=+1): tok 0: max(-1.5, -1.2) = -1.2 (clipped); tok 1: max(-0.5, -0.8) = -0.5 -> mean -0.85
    # seq 1 (A=-1): tok 0: max(1, 1) = 1 -> mean 1 ;  pg_loss = (-0.85 + 1) / 2 = 0.075
    # k3 with delta = ref - lp: ln2 -> 2 - ln2 - 1 = 0.3068528 ; 0 -> 0 ; -ln2 -> 0.5 + ln2 - 1 = 0.1931472
    #   seq means 0.1534264, 0.1931472 -> kl_div = 0.1732868
    # entropy seq means (1+3)/2 = 2, 2 -> 2
    # loss = 0.075 + 0.1 * 0.1732868 - 0.01 * 2 = 0.0723287
    assert m["pg_loss"] == pytest.approx(0.075, abs=1e-6)
    assert m["kl_div"] == pytest.approx(0.1732868, abs=1e-6)
    assert m["entropy"] == pytest.approx(2.0, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # seq 0: (1.5 + 0.5) / 2, seq 1: 1
    assert m["ratio_clipped_frac"] == pytest.approx(0.25, abs=1e-6)  # seq 0: 1/2, seq 1: 0
    assert float(loss.detach()) == pytest.approx(0.0723287, abs=1e-6)
    loss.backward()
    # the clipped token and the padding token get no policy-gradient; the clipped one still
    # gets the KL gradient: d/dlp [0.1 * (e^(ref-lp) - (ref-lp) - 1)] / 2 tokens / 2 seqs
    #   = 0.1 * (-2 + 1) / 4 = -0.025
    assert float(lp.grad[0, 0]) == pytest.approx(-0.025, abs=1e-6)
    assert float(lp.grad[1, 1]) == 0.0


def test_grpo_loss_on_policy_ratio_is_one():
    lp, _, _, adv, mask, _ = _loss_inputs()
    _, m = grpo_loss(lp, lp.detach(), lp.detach(), adv, mask, clip_eps=0.2, kl_coef=1.0)
    assert m["ratio_mean"] == 1.0 and m["kl_div"] == 0.0 and m["ratio_clipped_frac"] == 0.0


# -- end to end on the CPU ------------------------------------------------------------------------

SCALARS = ["loss", "pg_loss", "kl_div", "entropy", "reward_mean", "reward_std", "ratio_mean",
           "ratio_clipped_frac", "parity/tokens_compared", "parity/tokens_different", "parity/max_abs_diff",
           "time/rollout", "time/forward", "time/backward", "time/optimizer", "time/weight_sync"]
LAYERS = ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]


def _cfg(tiny_ckpt, tmp: Path, **kw) -> TrainConfig:
    base = dict(model=str(tiny_ckpt), engine="native", dtype="float32", device="cpu", task="synthetic",
                steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, lr=1e-3,
                kl_coef=0.1, entropy_coef=0.01, updates_per_batch=2, max_tokens_per_microbatch=40,
                checkpoint_every=1, out_dir=str(tmp / "runs"), checkpoint_dir=str(tmp / "ckpt"), run_name="full")
    return TrainConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def two_runs(tiny_ckpt, module_dir):
    """An uninterrupted 2-step run, and a run resumed from its step-1 checkpoint."""
    from spirl.loops.run import train

    tmp = module_dir
    full_cfg = _cfg(tiny_ckpt, tmp)
    full = train(full_cfg)
    resumed_cfg = _cfg(tiny_ckpt, tmp, run_name="resumed", resume=str(tmp / "ckpt" / "full" / "step_000001"))
    resumed = train(resumed_cfg)
    return tmp, full, resumed


def test_two_steps_write_all_tensorboard_scalars(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, full, _ = two_runs
    run_dir = tmp / "runs" / "full"
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    expected = SCALARS + [f"weight_delta/{layer}/{k}" for layer in LAYERS for k in ("magnitude", "relative_change")]
    missing = [t for t in expected if t not in tags]
    assert not missing, f"missing scalars: {missing}"
    assert [e.step for e in ea.Scalars("loss")] == [1, 2]
    for step in full:
        assert step["parity/tokens_different"] == 0 and step["parity/tokens_compared"] == 2 * 4 * 6
        assert step["skipped_update"] == 0.0
        assert step["weight_delta/layers.0/magnitude"] > 0
    # the second of the 2 updates per batch sees a changed policy, so the mean ratio is not 1
    assert full[0]["ratio_mean"] != 1.0
    assert (run_dir / "run_metadata.json").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_matches_uninterrupted(two_runs):
    from safetensors.torch import load_file

    tmp, full, resumed = two_runs
    assert len(resumed) == 1
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(resumed[0]) == strip(full[1])
    a = load_file(str(tmp / "ckpt" / "full" / "step_000002" / "model.safetensors"))
    b = load_file(str(tmp / "ckpt" / "resumed" / "step_000002" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(str(tmp / "ckpt" / "full" / "step_000002" / "optimizer.safetensors"))
    ob = load_file(str(tmp / "ckpt" / "resumed" / "step_000002" / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_all_zero_advantages_skip_update(tiny_ckpt, tmp_path):
    """A task whose reward is constant gives no learning signal: logged, no optimizer step."""
    from spirl import tasks
    from spirl.tasks.synthetic import SyntheticTask
    from spirl.loops.run import train

    class Constant(SyntheticTask):
        def reward(self, completion_ids, meta):
            return 1.0

    tasks.register("constant", Constant)
    hist = train(_cfg(tiny_ckpt, tmp_path, task="constant", steps=1, max_new_tokens=2))
    assert hist[0]["skipped_update"] == 1.0 and "loss" not in hist[0]


def test_parity_break_stops_with_report_and_keeps_checkpoint(tiny_ckpt, tmp_path, monkeypatch):
    """One engine logprob off by one ulp: ParityError, a report file, no checkpoint written."""
    from spirl.core import policy
    from spirl.loops import run
    from spirl.numerics import parity

    real = policy.build_engine

    def flipping_engine(cfg, model_dir, pol):
        engine = real(cfg, model_dir, pol)
        generate = engine.generate

        def generate_then_flip(*a, **kw):
            samples = generate(*a, **kw)
            lp = samples[3].logprobs
            lp[1] = torch.nextafter(lp[1], torch.tensor(0.0))
            return samples

        engine.generate = generate_then_flip
        return engine

    monkeypatch.setattr(policy, "build_engine", flipping_engine)
    with pytest.raises(parity.ParityError, match="different: 1"):
        run.train(_cfg(tiny_ckpt, tmp_path, steps=1, max_new_tokens=2))
    report = tmp_path / "runs" / "full" / "parity_failure_step000001.json"
    assert report.is_file() and '"sequence_index": 3' in report.read_text()
    assert not (tmp_path / "ckpt" / "full").exists()


def test_nan_loss_stops(tiny_ckpt, tmp_path, monkeypatch):
    from spirl.loops import run, update

    real = update.grpo_loss
    monkeypatch.setattr(update, "grpo_loss", lambda *a, **kw: (real(*a, **kw)[0] * float("nan"), real(*a, **kw)[1]))
    with pytest.raises(update.NonFiniteLossError):
        run.train(_cfg(tiny_ckpt, tmp_path, task="synthetic", steps=1, max_new_tokens=2))
    assert not (tmp_path / "ckpt" / "full").exists()


# -- config errors: one line on stderr, non-zero exit ----------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--group-size", "1"], "group_size must be >= 2"),
    (["--engine", "tpu"], "engine must be one of"),
    (["--clip-eps", "1.5"], "clip_eps"),
    (["--prompts-per-step", "3", "--group-size", "2", "--updates-per-batch", "4"], "updates_per_batch"),
    (["--steps", "two"], "--steps"),
    (["--eval-size", "-1"], "eval_size must be >= 1, or 0 for the task's whole held-out set"),
    (["--engine", "native", "--model", "/no/such/dir", "--dtype", "float32"], "does not exist"),
])
def test_bad_config_one_line_error(args, needle, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "simple_rl.py"), *args, "--checkpoint-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_help_lists_field_docs():
    r = subprocess.run([sys.executable, str(REPO / "simple_rl.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "--group-size" in r.stdout and "advantages are relative" in r.stdout


def test_every_field_has_a_docstring():
    from spirl.core.config import field_docs

    assert set(field_docs(TrainConfig)) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_task_rewards():
    from spirl.tasks.arith import score
    from spirl.tasks.gsm8k import score as gsm_score

    assert score(" 68<|im_end|>", 68) == 1.0 and score("68 and 3", 68) == 1.0
    assert score("7 is it", 68) == 0.1 and score("It is 68", 68) == 1.0 and score("no", 68) == 0.0
    assert gsm_score("so 1,234 in total.\n1,234", 1234.0) == 1.0 and gsm_score("12 then 13", 12.0) == 0.0


@pytest.mark.parametrize("name, needle", [("nosuchtask", "unknown task 'nosuchtask'"),
                                          ("calculator_tool", "is not a task (it has no make(tokenizer))")])
def test_get_task_refuses_what_is_not_a_task(name, needle):
    from spirl.tasks import TaskError, get_task

    with pytest.raises(TaskError, match=re.escape(needle)):
        get_task(name, tokenizer=None)
