"""--dataset (spirl/tasks/dataset.py): JSONL / parquet / directory files read with `datasets`, TRL's `prompt`
column (a string tokenized as text, chat messages through the chat template, each tokenized once), the other
columns handed to the reward functions per sample, the epoch order, and one line for every bad dataset."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from spirl.tasks.dataset import DataOrder, DatasetError, load_rows, make

REWARD = "def first(prompts, completions, completion_ids, answer, **kw):\n    return [float(a == 'x') for a in answer]\n"


@pytest.fixture(scope="module")
def tok():
    from torchtitan_compat.tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


def _cfg(path, reward, **kw):
    return SimpleNamespace(dataset=str(path), dataset_split="train", reward=(f"{reward}:first",), reward_weights="",
                           eval_dataset="", chat_template_kwargs="", steps=2, updates_per_batch=1, **kw)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": "What is 2+2?", "answer": "x", "id": 0},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}], "answer": "y",
         "id": 1}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_prompts_are_tokenized_once_as_trl_does(tmp_path, tok, fmt):
    import datasets

    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    paths = []
    for i, rows in enumerate(([ROWS[0]], [ROWS[1]])):  # one prompt type per file, as a dataset column has one type
        if fmt == "jsonl":
            paths.append(_write_jsonl(tmp_path / f"d{i}.jsonl", rows))
        elif fmt == "parquet":
            datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"d{i}.parquet"))
            paths.append(tmp_path / f"d{i}.parquet")
        else:
            datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / f"d{i}"))
            paths.append(tmp_path / f"d{i}")
    text_task, chat_task = (make(tok, _cfg(p, reward)) for p in paths)
    ids, meta = text_task.prompt_at(0)
    assert ids == tok(text="What is 2+2?")["input_ids"]  # TRL: processing_class(text=prompts)
    assert meta == {"row": 0, "prompt": "What is 2+2?", "columns": {"answer": "x", "id": 0}, "source": str(paths[0])}
    ids, meta = chat_task.prompt_at(0)
    expected = tok.apply_chat_template(ROWS[1]["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ids == list(expected["input_ids"])  # TRL: apply_chat_template(..., add_generation_prompt=True)
    assert text_task.prompt_at(0)[0] is text_task.prompt_at(0)[0]  # cached: tokenized once


def test_rewards_get_the_columns_and_trls_completions(tmp_path, tok):
    reward = tmp_path / "r.py"
    reward.write_text("SEEN = []\ndef first(prompts, completions, completion_ids, answer, id, **kw):\n"
                      "    SEEN.append((prompts, completions, completion_ids, answer, id))\n"
                      "    return [float(a == 'x') for a in answer]\n")
    task = make(tok, _cfg(_write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {**ROWS[0], "answer": "z", "id": 7}]), reward))
    c1, c2 = tok(text="hello")["input_ids"], tok(text=" world")["input_ids"] + [151645]
    s = task.score_batch([c1, c2], [task.prompt_at(0)[1], task.prompt_at(1)[1]], step=1)
    assert s.rewards.tolist() == [1.0, 0.0] and s.names == ["first"]
    seen = task.rewards.functions[0].fn.__globals__["SEEN"][-1]
    assert seen == (["What is 2+2?"] * 2, ["hello", " world"], [c1, c2], ["x", "z"], [0, 7])
    assert task.reward(c2, task.prompt_at(0)[1]) == 1.0  # the per-sample protocol: a batch of one
    chat = make(tok, _cfg(_write_jsonl(tmp_path / "c.jsonl", [ROWS[1]]), reward))
    chat.score_batch([c1], [chat.prompt_at(0)[1]])
    assert task.rewards.functions[0].fn.__globals__["SEEN"][-1][1] == [[{"role": "assistant", "content": "hello"}]]


def test_data_order_is_epochs_of_seeded_shuffles():
    order = DataOrder(7, seed=3)
    first = [order.index(p) for p in range(7)]
    second = [order.index(p) for p in range(7, 14)]
    assert sorted(first) == sorted(second) == list(range(7)) and first != second  # each epoch every row once
    again = DataOrder(7, seed=3)
    assert [again.index(p) for p in (12, 3, 0, 13)] == [second[5], first[3], first[0], second[6]]  # pure in position
    assert [DataOrder(7, seed=4).index(p) for p in range(7)] != first


@pytest.mark.parametrize("content, needle", [
    ('{"question": "q"}\n', "has no `prompt` column (its columns: question); name the column"),
    ('{"prompt": 3}\n', "the `prompt` column holds Value('int64'), not strings or chat messages"),
    ("", "bad.jsonl is empty (no rows); pass a file with at least one row"),
    ("\n  \n", "bad.jsonl is empty (no rows)"),
    ('{"prompt": "a"}\n{"prompt": ', "datasets could not read it"),
])
def test_a_bad_dataset_is_one_line(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=re.escape(needle)) as e:
        load_rows(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_missing_files_and_odd_suffixes_are_one_line(tmp_path):
    with pytest.raises(DatasetError, match="no such file or directory"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match=r"cannot read a \.txt file"):
        load_rows(str(tmp_path / "x.txt"))


@pytest.mark.parametrize("row, needle", [
    ({"prompt": None, "answer": "x"}, "row 1: `prompt` is None; give every row a prompt"),
    ({"prompt": "", "answer": "x"}, "row 1: `prompt` is ''"),
])
def test_a_bad_row_names_the_row(tmp_path, tok, row, needle):
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    task = make(tok, _cfg(_write_jsonl(tmp_path / "d.jsonl", [ROWS[0], row]), reward))
    task.prompt_at(0)
    with pytest.raises(DatasetError, match=re.escape(needle)):
        task.prompt_at(1)


def test_a_bad_chat_row_names_the_row(tmp_path, tok):
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    rows = [ROWS[1], {"prompt": [{"role": "user", "content": None}], "answer": "x", "id": 2}]
    task = make(tok, _cfg(_write_jsonl(tmp_path / "d.jsonl", rows), reward))
    with pytest.raises(DatasetError, match=re.escape("d.jsonl row 1: `prompt` must be a non-empty list of")):
        task.prompt_at(1)
