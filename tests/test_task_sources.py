"""Where --task finds a task: reasoning-gym's procedural datasets (its questions, its answer format, its own
score_answer), a task file outside the package, an importable module; and one line for every wrong --task."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from spirl.tasks import TaskError, get_task


@pytest.fixture(scope="module")
def tok():
    from torchtitan_compat.tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


def test_reasoning_gym_task_is_its_dataset_its_format_and_its_scorer(tok):
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    cfg = SimpleNamespace(task_size=20, task_seed=5, chat_template_kwargs='{"enable_thinking": false}')
    task = get_task("reasoning_gym:leg_counting", tok, cfg)
    theirs = reasoning_gym.create_dataset("leg_counting", size=20, seed=5)
    assert len(task) == 20
    ids, meta = task.prompt_at(4)
    assert meta["entry"] == theirs[4]
    text = tok.decode(ids)
    assert SYSTEM_PROMPTS["default"] in text and theirs[4]["question"] in text and "<answer>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the template kwargs reached it
    answer = theirs[4]["answer"]
    completions = [f"Let me count. <answer>{answer}</answer>", "<answer>0</answer>", f"{answer}", ""]
    s = task.score_batch([tok(text=c)["input_ids"] for c in completions], [meta] * 4)
    expected = [theirs.score_answer(a, theirs[4]) for a in (answer, "0", None, None)]
    assert s.rewards.tolist() == expected == [1.0, 0.0, 0.0, 0.0] and s.names == ["leg_counting"]
    assert task.reward(tok(text=completions[0])["input_ids"], meta) == 1.0  # the per-sample protocol too


def test_several_reasoning_gym_tasks_score_in_their_own_columns(tok):
    cfg = SimpleNamespace(task_size=30, task_seed=0, chat_template_kwargs="")
    task = get_task("reasoning_gym:leg_counting,basic_arithmetic", tok, cfg)
    metas = [task.prompt_at(i)[1] for i in range(30)]
    sources = [m["entry"]["metadata"]["source_dataset"] for m in metas]
    assert set(sources) == {"leg_counting", "basic_arithmetic"}
    right = [f"<answer>{m['entry']['answer']}</answer>" for m in metas]
    s = task.score_batch([tok(text=c)["input_ids"] for c in right], metas)
    assert s.rewards.tolist() == [1.0] * 30
    for i, src in enumerate(sources):  # the other name's column is None (NaN): not applicable
        j = s.names.index(src)
        assert s.per_func[i, j] == 1.0 and s.per_func[i, 1 - j].isnan()


def test_reasoning_gym_held_out_problems_follow_the_training_ones(tok):
    import reasoning_gym

    task = get_task("reasoning_gym:basic_arithmetic", tok, SimpleNamespace(task_size=50, task_seed=1,
                                                                           chat_template_kwargs=""))
    held_out = task.eval_problems()
    train_questions = {task.prompt_at(i)[1]["entry"]["question"] for i in range(50)}
    after = reasoning_gym.create_dataset("basic_arithmetic", size=60, seed=1)  # problem i is seeded with seed + i
    assert [m["entry"]["question"] for _, m in held_out[:10]] == [after[50 + i]["question"] for i in range(10)]
    assert not train_questions & {m["entry"]["question"] for _, m in held_out[:10]}


@pytest.mark.parametrize("spec, needle", [
    ("reasoning_gym:no_such_task", "unknown reasoning-gym dataset 'no_such_task'"),
    ("reasoning_gym:leg_counting,leg_counting", "names a dataset twice"),
    ("reasoning_gym", "--task reasoning_gym takes an argument: reasoning_gym:NAME[,NAME...]"),
    ("nosuchtask", "unknown task 'nosuchtask'"),
    ("/no/such/task.py", "there is no file /no/such/task.py"),
    ("NOTATASK", "made a int, which is not a task"),
    ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
])
def test_a_wrong_task_is_one_line(tmp_path, spec, needle):
    (tmp_path / "not_a_task.py").write_text("def make(tokenizer):\n    return 3\n")
    spec = spec.replace("NOTATASK", str(tmp_path / "not_a_task.py"))
    with pytest.raises(TaskError, match=re.escape(needle)) as e:
        get_task(spec, tokenizer=None, cfg=SimpleNamespace(task_size=5, task_seed=0, chat_template_kwargs=""))
    assert "\n" not in str(e.value)


TASK_FILE = '''
import random
from spirl.tasks import chat_prompt_ids

class Echo:
    name = "echo"
    def __init__(self, tokenizer):
        self.pool = [(chat_prompt_ids(tokenizer, f"Say {i}"), {"i": i}) for i in range(4)]
    def prompts(self, rng, n):
        return [self.pool[rng.randrange(4)] for _ in range(n)]
    def reward(self, completion_ids, meta):
        return float(len(completion_ids) % 2)

def make(tokenizer):
    return Echo(tokenizer)

def other(tokenizer):
    return Echo(tokenizer)
'''


def test_a_task_from_outside_the_package(tmp_path, tok, monkeypatch):
    (tmp_path / "mytask.py").write_text(TASK_FILE)
    by_file = get_task(str(tmp_path / "mytask.py"), tok)
    assert by_file.name == "echo" and by_file.reward([1, 2, 3], {}) == 1.0
    assert get_task(f"{tmp_path / 'mytask.py'}:other", tok).name == "echo"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_task("mytask:make", tok).prompts(__import__("random").Random(0), 2)
