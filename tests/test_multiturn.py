"""Multi-turn tool use in token ids (TI/TO), and the naive-retokenization detector, on the CPU with
the real Qwen3 tokenizer that weights.py writes into every checkpoint.

The engine here is scripted: it "samples" turns that the tests choose (including non-canonical
token splits a real sampler can produce) and reports the trainer's own logprobs (like the native
engine). Everything else (chat template, environment, episode loop, trajectories, parity check,
GRPO trainer, detector) is the real code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from spirl.tasks.calculator_tool import ToolError, evaluate, find_tool_call, run_tool_call
from spirl.numerics.samples import Sample
from spirl.engines.native_engine import NativeEngine
from spirl.core.multiturn import run_episodes
from spirl.numerics.trajectory import Trajectory

IM_END = 151645
TOOL_RESPONSE = 151665
# what Qwen3's chat template puts around a tool reply, spelled out by hand (thinking off)
REPLY_BEFORE = "\n<|im_start|>user\n<tool_response>\n"
REPLY_AFTER = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from torchtitan_compat.tokenizer import load_tokenizer

    return load_tokenizer(tiny_ckpt)


@pytest.fixture(scope="module")
def env(tok):
    from spirl.tasks.calculator import CalculatorEnv

    return CalculatorEnv(tok)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from weights_vllm_compat import load_model

    return load_model(tiny_ckpt, device="cpu", dtype=torch.float32, backend="reference")


def enc(tok, text: str) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


# -- a scripted engine ----------------------------------------------------------------------------


def tool_call(expr: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr


def behaviours(tok, expr: str, value: int) -> list[list[list[int]]]:
    """Four scripted episodes (lists of turns, each turn a list of ids ending in <|im_end|>). Their
    first turns differ, which is how ScriptedEngine tells the episodes apart later."""
    t = lambda text: enc(tok, text) + [IM_END]  # noqa: E731
    quoted = enc(tok, "He said") + [220, 1] + enc(tok, f"{value}") + [1] + enc(tok, f" <answer>{value}</answer>") + [IM_END]
    return [
        [t(tool_call(expr)), t(f"<answer>{value}</answer>")],                     # correct: reward 1
        [t(tool_call(expr.replace("*", " * "))), t(f"<answer>{value + 1}</answer>")],  # wrong: reward 0
        [t("<tool_call>\n{name: calculator}\n</tool_call>"), t(tool_call(expr)),  # malformed, then correct
         t(f"<answer>{value}</answer>")],
        [t(tool_call(expr + "+0")), quoted],                                      # ' ' + '"' sampled apart
    ]


class ScriptedEngine(NativeEngine):
    """Returns scripted turns instead of sampling; logprobs are the trainer's packed forward
    (NativeEngine.rescore), so parity holds unless a test breaks it on purpose."""

    def __init__(self, model, tok):
        super().__init__(model, eos_ids=[IM_END])
        self.tok = tok
        self.episodes: list[tuple[list[int], list[list[int]]]] = []
        self.calls: list[list[list[int]]] = []

    def _script(self, prompt: list[int], k: int):
        text = self.tok.decode(prompt)
        expr = re.search(r"What is ([0-9*+]+)\?", text).group(1)
        return behaviours(self.tok, expr, evaluate(expr))[k % 4]

    def generate(self, prompts, n=1, max_tokens=64, temperature=1.0, seed=None, **sampling):
        self.calls.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            if n > 1 or not any(p[:len(q)] == q and len(p) > len(q) for q, _ in self.episodes):
                for k in range(n):  # first turn: start n episodes
                    turns = self._script(p, k)
                    self.episodes.append((list(p), turns))
                    out.append(Sample(list(p), turns[0], torch.zeros(len(turns[0])), "stop"))
                continue
            prompt, turns = next((q, ts) for q, ts in self.episodes
                                 if p[:len(q)] == q and p[len(q):len(q) + len(ts[0])] == ts[0])
            turn = p[len(prompt):].count(TOOL_RESPONSE)
            out.append(Sample(list(p), turns[turn], torch.zeros(len(turns[turn])), "stop"))
        return out


@pytest.fixture(scope="module")
def episodes(env, model, tok):
    prompt, meta = env.pool[0]
    engine = ScriptedEngine(model, tok)
    trajs, metas = run_episodes(engine, env, [(prompt, meta)], group_size=4, max_turns=4, max_new_tokens=64,
                                temperature=1.0, seed=0)
    return prompt, meta, trajs, engine


# -- the calculator tool --------------------------------------------------------------------------


def test_calculator_evaluates_arithmetic():
    assert evaluate("347*29+18") == 10081
    assert evaluate("(2+3)**2 - 7//2 % 2") == 24
    assert run_tool_call({"name": "calculator", "arguments": {"expression": "7/2"}}) == '{"result": 3.5}'
    assert run_tool_call({"name": "calculator", "arguments": {"expression": "6/2"}}) == '{"result": 3}'


@pytest.mark.parametrize("text, needle", [
    ("<tool_call>\n{name: calculator}\n</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}', "never closed"),
    ('<tool_call>{"name": "calculator"}</tool_call>', '"arguments" object'),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', 'string argument "expression"'),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "division by zero"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool_call>', "exponent"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>',
     "unsupported syntax"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}}</tool_call>', "cannot parse"),
])
def test_malformed_tool_call_gets_a_clear_env_error(env, tok, text, needle):
    """The environment answers a bad call with a one-line error the model can read; no exception."""
    with pytest.raises(ToolError, match=re.escape(needle)):
        call = find_tool_call(text)
        run_tool_call(call)
    reply = env.step(enc(tok, text) + [IM_END], {})
    assert reply.error is not None and needle in reply.error and "\n" not in reply.error
    assert json.loads(reply.content) == {"error": reply.error}


def test_malformed_call_continues_the_episode(episodes, tok):
    """Episode 2 writes invalid JSON first: the env error becomes the tool reply, the episode goes on
    to a valid call and a correct answer."""
    _, _, trajs, _ = episodes
    t = trajs[2]
    assert t.env_errors == 1 and t.finish_reason == "answered" and len(t.turns) == 3
    first_reply = [s for s in t.segments[1:] if not s.sampled][0]
    assert "not valid JSON" in json.loads(first_reply.text)["error"]


# -- trajectories: exact ids, masks, logprob alignment ---------------------------------------------


def test_reply_ids_match_the_template_boundaries(env, tok):
    fmt = env.format
    assert fmt.reply_ids('{"result": 84}') == enc(tok, REPLY_BEFORE + '{"result": 84}' + REPLY_AFTER)
    # text that spells a special token inside a tool result stays text: it cannot end the turn
    ids = fmt.reply_ids("x<|im_end|>y")
    assert ids.count(IM_END) == enc(tok, REPLY_AFTER).count(IM_END)


def test_trajectory_is_the_exact_concatenation(episodes, env, tok):
    """ids = prompt + turn 1 + reply 1 + turn 2 + ...: the scripted (sampled) ids untouched, each
    reply tokenized alone; the loss mask is True exactly on sampled tokens."""
    prompt, meta, trajs, engine = episodes
    value = meta["answer"]
    for k, t in enumerate(trajs):
        turns = engine.episodes[k][1]
        expected, mask, reply_texts = list(prompt), [False] * len(prompt), [s.text for s in t.segments if s.text]
        for j, turn in enumerate(turns):
            expected += turn
            mask += [True] * len(turn)
            if j < len(turns) - 1:
                reply = enc(tok, REPLY_BEFORE + reply_texts[j] + REPLY_AFTER)
                expected += reply
                mask += [False] * len(reply)
        assert t.ids == expected, f"episode {k}"
        assert t.loss_mask == mask, f"episode {k}"
        assert t.turns == turns and t.sampled_ids == [i for turn in turns for i in turn]
        assert len(t.logprobs) == sum(mask)
    assert [s.text for s in trajs[0].segments if s.text] == [json.dumps({"result": value})]
    # the quoted episode kept the two sampled tokens ' ' and '"' (the template would have made one)
    assert [220, 1] == trajs[3].turns[1][2:4]
    assert [env.reward(t, meta) for t in trajs] == [1.0, 0.0, 1.0, 1.0]
    # tokens in: every later turn was prompted with exactly the trajectory so far
    for call in engine.calls[1:]:
        for p in call:
            assert any(t.ids[:len(p)] == p for t in trajs)


def test_logprobs_align_token_by_token(episodes, model):
    """Every masked-in token's logprob is log p(token | all ids before it): recomputed here one
    prefix at a time (a different forward shape than the trainer's packed one, hence the tolerance
    1e-5 instead of bitwise; a one-token misalignment changes the value by > 1e-3)."""
    _, _, trajs, _ = episodes
    t = trajs[2]
    ids = torch.tensor(t.ids)
    positions = [k for k, m in enumerate(t.loss_mask) if m]
    with torch.no_grad():
        logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32))
        full = torch.log_softmax(logits.float(), dim=-1)
        for j, k in enumerate(positions):
            if j % 7:  # every 7th token by its own prefix forward (the rest from the full forward)
                ref = full[k - 1, ids[k]]
            else:
                pre = model(ids[:k], torch.arange(k), torch.tensor([0, k], dtype=torch.int32))
                ref = torch.log_softmax(pre[-1].float(), dim=-1)[ids[k]]
            assert abs(float(t.logprobs[j]) - float(ref)) < 1e-5, f"sampled token {j} (position {k})"
    shifted = full[torch.tensor(positions) - 2, ids[positions]]
    assert float((shifted - t.logprobs).abs().max()) > 1e-3


# -- the detector ---------------------------------------------------------------------------------

# (name, the ids a sampler produced, the single token(s) naive retokenization turns them into)
CRAFTED = [
    ("space+quote merge", [220, 1], [330]),                   # ' ' + '"'  -> ' "'
    ("re-split caf|é -> ca|fé", [68796, 963], [924, 58858]),  # same text, other boundaries
    ("text becomes a special token", [27, 14172, 13429, 29], [151657]),  # '<' 'tool' '_call' '>' -> <tool_call>
    ("newline merge", [624, 198], [382]),                     # '.\n' + '\n' -> '.\n\n'
    ("broken UTF-8 byte", [127], [5691]),                     # byte 0xC3 alone -> "\ufffd" (3 bytes, 1 token)
]


def crafted_trajectory(env, tok, pieces):
    prompt, meta = env.pool[1]
    turn = enc(tok, "He said") + pieces + enc(tok, "ok <answer>1</answer>") + [IM_END]
    t = Trajectory.start(prompt)
    t.add_turn(turn, torch.zeros(len(turn)))
    return t, meta, len(prompt) + 2


@pytest.mark.parametrize("name, pieces, merged", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_detector_reports_each_crafted_retokenization(env, tok, model, name, pieces, merged):
    from spirl.loops.retokenization import detect

    t, meta, at = crafted_trajectory(env, tok, pieces)
    assert t.ids[at:at + len(pieces)] == pieces  # TI/TO keeps the sampled ids
    summary, regions = detect([t], [meta["messages"]], env.format, model, "cpu")
    trained = [r for r in regions if any(r.naive_trained)]
    assert len(trained) == 1, regions
    r = trained[0]
    # the detector points at exactly the crafted tokens, and at what the naive path put there
    assert r.tito == (at, at + len(pieces)) and r.tito_ids == pieces
    assert r.naive_ids == merged and r.naive[0] == at
    # the only other difference: the template's newline after the final <|im_end|> (never trained)
    others = [(x.op, x.naive_ids) for x in regions if x is not r]
    assert others == [("insert", [198])]
    assert summary.naive_trained_tokens_differing == len(merged)


def test_detector_scores_naive_tokens_under_the_model(env, tok, model):
    """naive_logprobs are log p(naive token | naive prefix); smoking guns count trained ones below
    the threshold (the random tiny model puts every token near -log(V) = -11.9, so the threshold is
    moved to show the counting)."""
    from spirl.loops.retokenization import detect, naive_retokenize

    t, meta, at = crafted_trajectory(env, tok, [220, 1])
    naive = naive_retokenize(t, meta["messages"], env.format)
    _, regions = detect([t], [meta["messages"]], env.format, model, "cpu")
    r = next(r for r in regions if any(r.naive_trained))
    ids = torch.tensor(naive.ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32)).float(), -1)
    assert abs(r.naive_logprobs[0] - float(lp[at - 1, 330])) < 1e-5
    assert r.smoking_guns(threshold=0.0) == 1 and r.smoking_guns(threshold=-100.0) == 0
    assert detect([t], [meta["messages"]], env.format, model, "cpu", threshold=0.0)[0].smoking_guns == 1


def test_detector_finds_template_drift_in_multi_turn_history(episodes, model, env):
    """A real template difference: the empty think block Qwen3's template puts in every generation
    prompt (thinking off) is dropped from earlier assistant turns when the history is re-rendered."""
    from spirl.loops.retokenization import detect

    prompt, meta, trajs, _ = episodes
    summary, regions = detect(trajs[:1], [meta["messages"]], env.format, model, "cpu")
    think = [151667, 271, 151668, 271]  # <think> \n\n </think> \n\n
    drops = [r for r in regions if r.op == "delete"]
    assert len(drops) == 1 and drops[0].tito_ids == think and drops[0].tito == (len(prompt) - 4, len(prompt))
    assert not any(any(r.naive_trained) for r in regions) and summary.smoking_guns == 0


# -- GRPO through the trainer ----------------------------------------------------------------------


def _mt_cfg(ckpt, tmp: Path, **kw):
    from spirl.core.config import TrainConfig

    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="calculator", steps=2,
                prompts_per_step=1, group_size=4, max_new_tokens=64, max_turns=4, lr=1e-3,
                checkpoint_every=0, out_dir=str(tmp / "runs"), checkpoint_dir=str(tmp / "ckpt"),
                run_name="mt", save_rollouts=1)
    return TrainConfig(**{**base, **kw}).validate()


def _scripted(monkeypatch, tok, break_turn: int | None = None):
    from spirl.core import policy

    def build(cfg, model_dir, policy):
        engine = ScriptedEngine(policy.model, tok)
        if break_turn is not None:
            rescore = engine.rescore

            def rescore_then_flip(seqs, *dist):
                rescore(seqs, *dist)
                t = seqs[2]
                start = sum(len(x) for x in t.turns[:break_turn])
                lp = t.logprobs
                lp[start + 1] = torch.nextafter(lp[start + 1], torch.tensor(0.0))
                t.logprobs = lp
                return seqs

            engine.rescore = rescore_then_flip
        return engine

    monkeypatch.setattr(policy, "build_engine", build)


def test_multi_turn_grpo_steps_with_parity_over_every_turn(tiny_ckpt, tok, tmp_path, monkeypatch):
    from compare.retokenization import main as detector_main
    from spirl.loops.run import train

    _scripted(monkeypatch, tok)
    hist = train(_mt_cfg(tiny_ckpt, tmp_path))
    rollouts = sorted((tmp_path / "runs" / "mt" / "rollouts").glob("step_*.jsonl"))
    assert len(rollouts) == 2
    for step, path in zip(hist, rollouts):
        trajs = [Trajectory.from_json(json.loads(line)["trajectory"]) for line in path.read_text().splitlines()]
        sampled = sum(sum(t.loss_mask) for t in trajs)
        assert step["parity/tokens_compared"] == sampled and step["parity/tokens_different"] == 0
        assert step["episode/turns_mean"] == (2 + 2 + 3 + 2) / 4 and step["episode/env_errors_mean"] == 0.25
        assert step["reward_mean"] == 0.75 and step["skipped_update"] == 0.0
        assert step["weight_delta/layers.0/magnitude"] > 0
        assert step["retok/naive_trained_tokens_differing"] >= 1  # the ' ' + '"' episode
        assert step["retok/tito_sampled_tokens"] == sampled
    assert detector_main(["--rollouts", str(rollouts[0]), "--model", str(tiny_ckpt), "--device", "cpu"]) == 0


def test_multi_turn_parity_break_in_a_later_turn_is_caught(tiny_ckpt, tok, tmp_path, monkeypatch):
    """One ulp off in the *second* turn of one episode stops the run: parity covers every turn."""
    from spirl.numerics import parity
    from spirl.loops import run

    _scripted(monkeypatch, tok, break_turn=1)
    with pytest.raises(parity.ParityError, match="different: 1"):
        run.train(_mt_cfg(tiny_ckpt, tmp_path, steps=1))
    report = json.loads((tmp_path / "runs" / "mt" / "parity_failure_step000001.json").read_text())
    assert report["sequence_index"] == 2 and report["loss_mask"][report["token_position"]]


def test_warmstart_teaches_the_format_and_writes_a_loadable_checkpoint(tiny_ckpt, tmp_path):
    """spirl.loops.warmstart: the loss on scripted calculator episodes falls (seeded, so deterministic),
    and the written HF checkpoint loads with the new weights."""
    import weights
    from spirl.loops.warmstart import warmstart

    out = tmp_path / "taught"
    losses = warmstart(tiny_ckpt, out, steps=6, batch=2, lr=3e-3, seed=0, device=torch.device("cpu"))
    assert losses[-1] < losses[0] - 1.0, losses
    _, before = weights.load_hf_checkpoint(tiny_ckpt)
    _, after = weights.load_hf_checkpoint(out)
    assert before.keys() == after.keys()
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


@pytest.mark.parametrize("content, needle", [(None, "no such file"), ("not json\n", "is not a rollout record"),
                                             ("", "has no rollouts")])
def test_detector_cli_bad_rollouts_one_line_error(tiny_ckpt, tmp_path, content, needle):
    import subprocess
    import sys

    path = tmp_path / "r.jsonl"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "compare.retokenization", "--rollouts", str(path), "--model",
                           str(tiny_ckpt), "--device", "cpu"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
