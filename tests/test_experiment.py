"""Your own experiment, end to end on the CPU (random tiny model, native engine, float32): a JSONL dataset with
a reward function from a file outside the project, the GPU command's dapo + clip-higher + dynamic sampling;
resume continuing the data order bit for bit; a parquet dataset with two weighted rewards; a reasoning-gym task;
a task file outside the package; 2 gloo ranks keeping and training what one process does; one line for a bad
reward function and a bad dataset. Parity is 0 on every step of every run.

The reward function `by_mode` makes dynamic sampling's choices known in advance: on a row whose `mode` is
`flat` both samples of its group get 1.0 (equal rewards: the group is dropped), on a `vary` row they get 0 and 1
(kept). The dataset's rows are laid out so that, in the run's data order, step 1 keeps one group per round (a
refill), step 2 finds one `vary` row in 3 rounds (the round limit: it trains on that one group), step 3 keeps
both groups of its first round. Every call of a reward function is appended to a log, from which the test
recomputes what the run logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spirl.core.config import TrainConfig
from spirl.tasks.dataset import DataOrder

REPO = Path(__file__).resolve().parents[1]
SEED = 0
MODES = ["vary", "flat", "flat", "vary", "flat", "flat", "flat", "flat", "vary", "flat", "vary", "vary"]
"""The mode of the row at each position of the run's data order (epoch 0)."""
EXPECTED = {1: dict(rounds=2, sampled=4, dropped=2, kept=2, limit=0),
            2: dict(rounds=3, sampled=6, dropped=5, kept=1, limit=1),
            3: dict(rounds=1, sampled=2, dropped=0, kept=2, limit=0)}
"""dynamic/* of each step, read off MODES with --prompts-per-step 2 and --dynamic-sampling-max-rounds 3."""

REWARDS = '''
import json, os

def _log(name, ids, out, trainer_state):
    with open(os.environ["SPIRL_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"fn": name, "step": trainer_state.global_step + 1, "id": ids, "out": out}) + "\\n")

def by_mode(prompts, completions, completion_ids, mode, id, trainer_state, **kwargs):
    out = [float(i % 2) if m == "vary" else 1.0 for i, m in enumerate(mode)]
    _log("by_mode", id, out, trainer_state)
    return out

def length_bonus(prompts, completions, completion_ids, id, trainer_state, **kwargs):
    out = [len(c) / 10 for c in completion_ids]
    _log("length_bonus", id, out, trainer_state)
    return out

def raises(prompts, completions, completion_ids, **kwargs):
    return [1.0 / (len(c) - len(c)) for c in completion_ids]

def never(prompts, completions, completion_ids, **kwargs):
    return [None for _ in completion_ids]
'''


@contextmanager
def reward_log(path: Path):
    old = os.environ.get("SPIRL_TEST_REWARD_LOG")
    os.environ["SPIRL_TEST_REWARD_LOG"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            del os.environ["SPIRL_TEST_REWARD_LOG"]
        else:
            os.environ["SPIRL_TEST_REWARD_LOG"] = old


def _calls(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def files(module_dir):
    perm = DataOrder(len(MODES), SEED).permutation(0)
    rows = [None] * len(MODES)
    for position, row in enumerate(perm):  # the row read at `position` gets MODES[position]
        rows[row] = {"prompt": f"Count to {row}.", "mode": MODES[position], "id": row}
    (module_dir / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (module_dir / "my_rewards.py").write_text(REWARDS)
    return module_dir


def _cfg(tiny_ckpt, root: Path, name: str, **kw) -> TrainConfig:
    base = dict(model=str(tiny_ckpt), engine="native", dtype="float32", device="cpu", seed=SEED,
                prompts_per_step=2, group_size=2, max_new_tokens=4, lr=1e-4, checkpoint_every=1,
                out_dir=str(root / "runs"), checkpoint_dir=str(root / "ck"), run_name=name)
    return TrainConfig(**{**base, **kw}).validate()


def _dapo(tiny_ckpt, files, name, **kw):
    return _cfg(tiny_ckpt, files, name, dataset=str(files / "data.jsonl"),
                reward=(f"{files / 'my_rewards.py'}:by_mode",), loss_type="dapo", clip_eps_high=0.28,
                dynamic_sampling=1, dynamic_sampling_max_rounds=3, steps=3, entropy_coef=0.01, **kw)


@pytest.fixture(scope="module")
def dapo_runs(tiny_ckpt, files):
    """The uninterrupted 3-step run, and one resumed from its step-2 checkpoint (another run name)."""
    from spirl.loops.run import train

    with reward_log(files / "full.log"):
        full = train(_dapo(tiny_ckpt, files, "full"))
    with reward_log(files / "resumed.log"):
        resumed = train(_dapo(tiny_ckpt, files, "resumed", resume=str(files / "ck" / "full" / "step_000002")))
    return full, resumed


def _by_step(calls: list[dict], fn: str = "by_mode") -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for c in calls:
        if c["fn"] == fn:
            out.setdefault(c["step"], []).append(c)
    return out


@pytest.mark.slow
def test_dynamic_sampling_drops_refills_and_stops_at_the_round_limit(dapo_runs, files):
    full, _ = dapo_runs
    calls = _by_step(_calls(files / "full.log"))
    order = DataOrder(len(MODES), SEED)
    position = 0
    for step, m in enumerate(full, start=1):
        e = EXPECTED[step]
        assert m["parity/tokens_different"] == 0 and m["skipped_update"] == 0.0
        assert (m["dynamic/rounds"], m["dynamic/groups_sampled"], m["dynamic/groups_dropped"],
                m["dynamic/groups_kept"], m["dynamic/round_limit"]) == (e["rounds"], e["sampled"], e["dropped"],
                                                                         e["kept"], e["limit"])
        # each round's reward call saw the next rows of the data order, two samples each
        drawn = [i for c in calls[step] for i in c["id"][::2]]
        assert drawn == [order.index(p) for p in range(position, position + e["sampled"])], step
        position += e["sampled"]
        # parity covers every sampled token, kept or dropped; only the kept groups are trained on
        samples = e["sampled"] * 2
        assert m["parity/tokens_compared"] == m["completion_len_mean"] * samples
        assert m["tokens_trained"] <= m["completion_len_mean"] * samples
        if e["dropped"]:
            assert m["tokens_trained"] < m["parity/tokens_compared"]
        # the logged reward is the function's own outputs' mean, over every sampled completion
        outs = [x for c in calls[step] for x in c["out"]]
        assert m["reward/by_mode"] == pytest.approx(sum(outs) / len(outs), abs=1e-7)
        assert m["reward_mean"] == pytest.approx(sum(outs) / len(outs), abs=1e-7)
    state = json.loads((files / "ck" / "full" / "step_000003" / "state.json").read_text())
    assert state["data_position"] == position == 12


@pytest.mark.slow
def test_the_run_records_its_loss_and_sampling_choices(dapo_runs, files):
    meta = json.loads((files / "runs" / "full" / "run_metadata.json").read_text())["args"]
    state = json.loads((files / "ck" / "full" / "step_000003" / "state.json").read_text())["config"]
    for record in (meta, state):
        assert (record["loss_type"], record["clip_eps_high"], record["dynamic_sampling"], record["scale_rewards"],
                record["importance_sampling_level"], record["mask_truncated_completions"]) == \
            ("dapo", 0.28, 1, "group", "token", 0)
        assert record["reward"] == [f"{files / 'my_rewards.py'}:by_mode"]


@pytest.mark.slow
def test_resume_continues_the_data_order_bit_for_bit(dapo_runs, files):
    full, resumed = dapo_runs
    assert len(resumed) == 1
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert strip(resumed[0]) == strip(full[2])
    assert _by_step(_calls(files / "resumed.log"))[3] == _by_step(_calls(files / "full.log"))[3]
    for what in ("model", "optimizer"):
        a = load_file(str(files / "ck" / "full" / "step_000003" / f"{what}.safetensors"))
        b = load_file(str(files / "ck" / "resumed" / "step_000003" / f"{what}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), what
    assert (files / "ck" / "full" / "step_000003" / "state.json").read_bytes() == \
        (files / "ck" / "resumed" / "step_000003" / "state.json").read_bytes()


def test_parquet_dataset_with_two_weighted_rewards(tiny_ckpt, files):
    """Two functions weighted 1 and 0.5; every completion cut at --max-new-tokens is masked
    (--mask-truncated-completions), so the dr_grpo loss is exactly 0; --scale-rewards batch; the JSONL file as
    --eval-dataset, scored by the same functions before step 1 and after step 2."""
    import datasets

    from spirl.loops.run import train

    rows = [json.loads(x) for x in (files / "data.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(files / "data.parquet"))
    cfg = _cfg(tiny_ckpt, files, "parquet", dataset=str(files / "data.parquet"), steps=2, checkpoint_every=0,
               reward=(f"{files / 'my_rewards.py'}:by_mode", f"{files / 'my_rewards.py'}:length_bonus"),
               reward_weights="1,0.5", loss_type="dr_grpo", mask_truncated_completions=1, scale_rewards="batch",
               entropy_coef=0.01,
               eval_dataset=str(files / "data.jsonl"), eval_every=2)
    with reward_log(files / "parquet.log"):
        hist = train(cfg)
    calls = _calls(files / "parquet.log")
    evals = [c for c in calls if len(c["id"]) == len(MODES)]  # the eval's calls score every held-out row at once
    assert len(evals) == 4 and all(c["id"] == list(range(len(MODES))) for c in evals)  # 2 evals x 2 functions
    calls = [c for c in calls if c not in evals]
    final = [json.loads(x) for x in (files / "runs" / "parquet" / "metrics.jsonl").read_text().splitlines()]
    for m, (a, b) in zip([final[0], final[-1]], [evals[:2], evals[2:]]):
        total = [x + 0.5 * y for x, y in zip(a["out"], b["out"])]
        assert m["eval/accuracy"] == sum(t >= 1.0 for t in total) / len(total)
        assert m["eval/reward/by_mode"] == pytest.approx(sum(a["out"]) / len(a["out"]), abs=1e-7)
        assert m["eval/reward/length_bonus"] == pytest.approx(sum(b["out"]) / len(b["out"]), abs=1e-7)
    for step, m in enumerate(hist, start=1):
        a = [x for c in _by_step(calls, "by_mode")[step] for x in c["out"]]
        b = [x for c in _by_step(calls, "length_bonus")[step] for x in c["out"]]
        assert m["parity/tokens_different"] == 0 and m["parity/tokens_compared"] > 0
        assert m["reward/by_mode"] == pytest.approx(sum(a) / len(a), abs=1e-7)
        assert m["reward/length_bonus"] == pytest.approx(sum(b) / len(b), abs=1e-7)
        assert m["reward_mean"] == pytest.approx(sum(x + 0.5 * y for x, y in zip(a, b)) / len(a), abs=1e-6)
        # both steps draw a `vary` row (an update), and the random model never stops before 4 tokens: every
        # completion is truncated, so masked, and the loss is exactly 0 (its entropy term included)
        assert m["skipped_update"] == 0.0 and m["completion_len_mean"] == 4
        assert m["loss"] == 0.0 and m["pg_loss"] == 0.0


OTHER_REWARD = '''
import json, os

def scored_only(completions, kind, **kwargs):
    """Another signature (keywords only, no prompts or ids); None where a row's `kind` is "skip"."""
    out = [None if k == "skip" else float(len(c[0]["content"]) % 2) for c, k in zip(completions, kind)]
    with open(os.environ["SPIRL_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"fn": "scored_only", "step": kwargs["trainer_state"].global_step + 1, "out": out}) + "\\n")
    return out
'''


def test_a_saved_dataset_with_chat_prompts_and_rewards_that_return_none(tiny_ckpt, files):
    """Another layout (a `save_to_disk` directory, chat-message prompts), another reward signature, and rewards
    that return None: `math` on rows whose gold answer does not parse, `scored_only` on rows marked skip. Parity
    0 at every step; reward/<f> is the mean of what each function returned for the samples it applied to."""
    import datasets

    from spirl.loops.run import train

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "answer": str(2 * i) if i % 2 == 0 else "n/a", "kind": "skip" if i % 3 == 0 else "score"}
            for i in range(8)]
    datasets.Dataset.from_list(rows).save_to_disk(str(files / "chat_saved"))
    (files / "other_rewards.py").write_text(OTHER_REWARD)
    cfg = _cfg(tiny_ckpt, files, "chat_saved", dataset=str(files / "chat_saved"), steps=2, checkpoint_every=0,
               reward=("math", f"{files / 'other_rewards.py'}:scored_only"))
    with reward_log(files / "chat_saved.log"):
        hist = train(cfg)
    calls = _by_step(_calls(files / "chat_saved.log"), "scored_only")
    nones = 0
    for step, m in enumerate(hist, start=1):
        assert m["parity/tokens_different"] == 0 and m["parity/tokens_compared"] > 0
        out = [x for c in calls[step] for x in c["out"]]
        applied = [x for x in out if x is not None]
        nones += len(out) - len(applied)
        if applied:
            assert m["reward/scored_only"] == pytest.approx(sum(applied) / len(applied), abs=1e-7)
    assert nones > 0  # some samples were not applicable, and the run went on


def test_rewards_that_never_apply_say_nothing_could_be_scored(tiny_ckpt, files, caplog, recwarn):
    """Every reward function returns None for every completion: the step says that nothing could be scored (not
    that the groups' rewards are equal), takes no update, logs reward_mean and reward_std as NaN, and torch
    warns of nothing (no std over zero samples)."""
    from spirl.loops.run import train

    cfg = _cfg(tiny_ckpt, files, "never", dataset=str(files / "data.jsonl"), steps=1, checkpoint_every=0,
               reward=(f"{files / 'my_rewards.py'}:never",))
    with caplog.at_level("WARNING", logger="spirl.loops"):
        hist = train(cfg)
    m = hist[0]
    assert m["skipped_update"] == 1.0 and m["parity/tokens_different"] == 0
    assert m["reward_mean"] != m["reward_mean"] and m["reward_std"] != m["reward_std"]  # NaN
    lines = [r.getMessage() for r in caplog.records]
    assert any("step 1: nothing could be scored (every reward function returned None" in x for x in lines), lines
    assert not any("equal rewards" in x for x in lines)
    assert not [w for w in recwarn if "degrees of freedom" in str(w.message)]


def test_advantage_std_sample_reaches_the_advantages_and_reward_std(tiny_ckpt, files, monkeypatch):
    """--advantage-std sample against the default on the same step: the step's advantages are the ones
    grpo_advantages computes with std="sample" (TRL's: tests/test_losses.py), reward_std is the Bessel-corrected
    std of the same rewards (sqrt(n / (n - 1)) times the population one), the samples are the same."""
    import math

    from spirl.loops import rollout
    from spirl.loops.run import train

    runs, calls = {}, []
    real = rollout.grpo_advantages
    monkeypatch.setattr(rollout, "grpo_advantages", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for std in ("population", "sample"):
        cfg = _cfg(tiny_ckpt, files, f"std_{std}", dataset=str(files / "data.jsonl"), steps=1, checkpoint_every=0,
                   reward=(f"{files / 'my_rewards.py'}:by_mode",), advantage_std=std)
        with reward_log(files / f"std_{std}.log"):
            runs[std] = train(cfg)[0]
    assert [c["std"] for c in calls] == ["population", "sample"]
    pop, sample = runs["population"], runs["sample"]
    assert pop["reward_mean"] == sample["reward_mean"] and pop["completion_len_mean"] == sample["completion_len_mean"]
    n = 4  # prompts_per_step 2 x group_size 2
    assert pop["reward_std"] > 0 and math.isclose(sample["reward_std"], pop["reward_std"] * math.sqrt(n / (n - 1)),
                                                    rel_tol=1e-6)
    assert pop["skipped_update"] == sample["skipped_update"] == 0.0


def test_reasoning_gym_task_runs_with_parity(tiny_ckpt, files):
    """The GPU command's path on a reasoning-gym task: dapo, clip-higher, dynamic sampling, masked truncated
    completions. A random model answers nothing right: every group is dropped, every round sampled and
    checked, and the step trains on nothing (no update)."""
    from spirl.loops.run import train

    cfg = _cfg(tiny_ckpt, files, "rg", task="reasoning_gym:leg_counting", task_size=50, steps=2, checkpoint_every=0,
               loss_type="dapo", clip_eps_high=0.28, dynamic_sampling=1, dynamic_sampling_max_rounds=2,
               mask_truncated_completions=1)
    hist = train(cfg)
    for m in hist:
        assert m["parity/tokens_different"] == 0 and m["parity/tokens_compared"] == m["completion_len_mean"] * 8
        assert m["dynamic/rounds"] == 2 and m["reward/leg_counting"] == 0.0 and m["skipped_update"] == 1.0


def test_a_task_file_from_outside_the_package(tiny_ckpt, files):
    from spirl.loops.run import train

    (files / "mytask.py").write_text(
        "from spirl.tasks import chat_prompt_ids\n"
        "class Odd:\n"
        "    name = 'odd'\n"
        "    def __init__(self, tok):\n"
        "        self.pool = [(chat_prompt_ids(tok, f'Say {i}'), {}) for i in range(3)]\n"
        "    def prompts(self, rng, n):\n"
        "        return [self.pool[rng.randrange(3)] for _ in range(n)]\n"
        "    def reward(self, completion_ids, meta):\n"
        "        return float(completion_ids[0] % 2)\n"
        "def make(tokenizer):\n"
        "    return Odd(tokenizer)\n")
    hist = train(_cfg(tiny_ckpt, files, "taskfile", task=str(files / "mytask.py"), steps=1, checkpoint_every=0))
    assert hist[0]["parity/tokens_different"] == 0 and hist[0]["parity/tokens_compared"] > 0


def _cli(files: Path, *args: str, ranks: int = 0, log: str = "cli.log") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "simple_rl.py")]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "simple_rl.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPIRL_TEST_REWARD_LOG": str(files / log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([*cmd, "--engine", "native", "--dtype", "float32", "--out-dir", str(files / "runs"),
                           "--checkpoint-dir", str(files / "ck"), *args], capture_output=True, text=True, env=env,
                          timeout=900, cwd=files)


@pytest.mark.slow
def test_two_ranks_keep_and_train_what_one_process_does(tiny_ckpt, files, dapo_runs):
    """The dapo run on 2 gloo ranks: the same groups kept and dropped, the same rewards and parity counts; at
    step 2 one group is kept, so rank 1 trains a zero-weight placeholder, and the loss (its entropy term is
    normalized by dapo's token count over both ranks) and the gradient are still one process's, to fp32
    rounding (the ranks' sums are added in another order): the loss to 1e-5 relative, AdamW's exp_avg (the
    gradients' running mean) to 1e-5 of its largest element (measured 1.3e-6); a rank-local normalizer would
    be off by a factor of 2 at step 2. Weights: as tests/test_distributed.py bounds them."""
    full, _ = dapo_runs
    r = _cli(files, "--model", str(tiny_ckpt), "--dataset", str(files / "data.jsonl"), "--reward",
             f"{files / 'my_rewards.py'}:by_mode", "--loss-type", "dapo", "--clip-eps-high", "0.28",
             "--dynamic-sampling", "1", "--dynamic-sampling-max-rounds", "3", "--steps", "3", "--seed", str(SEED),
             "--entropy-coef", "0.01",
             "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--lr", "1e-4",
             "--checkpoint-every", "0", "--run-name", "ranks2", ranks=2, log="ranks2.log")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = [json.loads(x) for x in (files / "runs" / "ranks2" / "metrics.jsonl").read_text().splitlines()]
    same = ["reward_mean", "reward_std", "reward/by_mode", "parity/tokens_compared", "parity/tokens_different",
            "completion_len_mean", "tokens_trained", "skipped_update"] + [k for k in full[0] if k.startswith("dynamic/")]
    for one, m in zip(full, two):
        assert {k: m[k] for k in same} == {k: one[k] for k in same}
        for k in ("loss", "pg_loss", "entropy", "ratio_mean"):
            assert m[k] == pytest.approx(one[k], rel=1e-5, abs=1e-9), k
    assert two[1]["parity/rank0/tokens_compared"] + two[1]["parity/rank1/tokens_compared"] == \
        two[1]["parity/tokens_compared"]
    one_calls, two_calls = _by_step(_calls(files / "full.log")), _by_step(_calls(files / "ranks2.log"))
    for step in (1, 2, 3):  # every rank scores its half of each round: together, the one process's rows
        assert sorted(i for c in two_calls[step] for i in c["id"]) == sorted(i for c in one_calls[step] for i in c["id"])
    assert all(m["loss"] != 0 for m in two)
    o1 = load_file(str(files / "ck" / "full" / "step_000003" / "optimizer.safetensors"))
    o2 = load_file(str(files / "ck" / "ranks2" / "step_000003" / "optimizer.safetensors"))
    for k in (k for k in o1 if k.endswith(".exp_avg")):
        scale = float(o1[k].abs().max())
        assert scale > 0 and float((o1[k] - o2[k]).abs().max()) <= 1e-5 * scale, k
    w1 = load_file(str(files / "ck" / "full" / "step_000003" / "model.safetensors"))
    w2 = load_file(str(files / "ck" / "ranks2" / "step_000003" / "model.safetensors"))
    total = far = 0
    for k in w1:  # a gradient element that cancels to ~0 turns a rounding difference into up to 2 lr a step
        d = (w1[k] - w2[k]).abs()
        assert float(d.max()) <= 3 * 2 * 1e-4, k
        total, far = total + d.numel(), far + int((d > 1e-3 * 1e-4).sum())
    assert far <= 1e-5 * total


def test_a_failing_reward_function_is_one_line_and_loses_nothing(tiny_ckpt, files):
    r = _cli(files, "--model", str(tiny_ckpt), "--dataset", str(files / "data.jsonl"), "--reward",
             f"{files / 'my_rewards.py'}:raises", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
             "--max-new-tokens", "2", "--run-name", "raises")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "reward function raises" in lines[0] and "ZeroDivisionError" in lines[0]
    assert f"the 4 samples of step 1 ({files / 'data.jsonl'} row " in lines[0]  # the batch: step, file, rows
    assert "nothing is lost: step 1 was not applied" in lines[0]
    assert not (files / "ck" / "raises").exists()


@pytest.mark.parametrize("args, needle", [
    (["--dataset", "BAD", "--reward", "math"], "has no `prompt` column (its columns: question)"),
    (["--dataset", "DATA"], "--dataset needs at least one --reward"),
    (["--dataset", "DATA", "--reward", "REWARDS:by_mode", "--task", "gsm8k"], "--dataset and --task gsm8k both"),
    (["--dataset", "DATA", "--reward", "REWARDS:nope"], "has no function 'nope'"),
    (["--reward", "math"], "--reward, --reward-weights and --eval-dataset go with --dataset"),
    (["--loss-type", "cispo"], "--loss-type cispo needs --clip-eps-high"),
    (["--loss-type", "ppo"], "loss_type must be one of grpo, dr_grpo, dapo, bnpo, cispo"),
])
def test_bad_experiment_setups_are_one_line(files, args, needle):
    (files / "bad.jsonl").write_text('{"question": "q"}\n')
    args = [a.replace("BAD", str(files / "bad.jsonl")).replace("DATA", str(files / "data.jsonl"))
            .replace("REWARDS", str(files / "my_rewards.py")) for a in args]
    r = _cli(files, "--model", "random:tiny", *args, "--run-name", "bad")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
