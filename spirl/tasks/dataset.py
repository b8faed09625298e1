"""`--dataset PATH`: your own prompts, read with `datasets`, scored by TRL-signature reward functions.

PATH: a JSONL / JSON / parquet / CSV file, a directory (`datasets.load_from_disk`'s, or data files
`datasets.load_dataset` reads), or an id `datasets.load_dataset` takes (the Hub needs a network; a local
path never does). The `prompt` column is TRL's: a string (tokenized as text, as TRL's GRPOTrainer does) or
a list of chat messages (rendered by the tokenizer's chat template with the generation prompt, with
--chat-template-kwargs). Each prompt is tokenized once, on first use; its ids are what is sampled from and
trained on. Every other column goes to the reward functions (spirl.tasks.rewards), one value per sample.

Order (`DataOrder`): epochs, each a seeded shuffle of every row; position p is row perm_e[p % n] with
e = p // n and perm_e = the shuffle of 0..n-1 by random.Random(f"spirl-data-order:{seed}:{e}"), seed =
--seed. The run keeps the position and writes it into every checkpoint, so --resume continues the same
order (spirl.loops.rollout).
"""

from __future__ import annotations

import json
import logging
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import Meta, chat_ids
from .rewards import RewardSet, Scored, trainer_state

log = logging.getLogger("spirl.tasks.dataset")

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""`datasets.load_dataset` builder of each data file suffix."""
EXCLUDED_COLUMNS = ("prompt", "completion", "completion_ids")
"""Columns not passed to reward functions as keyword arguments (TRL passes the others)."""


class DatasetError(ValueError):
    """A dataset cannot be read or has a bad row; one line naming the file, the column or the row."""


# -- order ----------------------------------------------------------------------------------------------------


@dataclass
class DataOrder:
    """Epochs of seeded shuffles of `size` rows (module docstring): a pure function of (seed, position)."""

    size: int
    seed: int
    _epoch: int = field(default=-1, repr=False)
    _perm: list[int] = field(default_factory=list, repr=False)

    def permutation(self, epoch: int) -> list[int]:
        """The rows of epoch `epoch`, in order."""
        perm = list(range(self.size))
        random.Random(f"spirl-data-order:{self.seed}:{epoch}").shuffle(perm)
        return perm

    def index(self, position: int) -> int:
        """The row at `position` (0-based, counted over every epoch)."""
        epoch = position // self.size
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, self.permutation(epoch)
        return self._perm[position % self.size]


# -- reading --------------------------------------------------------------------------------------------------


@contextmanager
def _quiet_progress():
    """datasets' progress bars off while loading (stderr holds only an error's one line), then as they were."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def load_rows(path: str, split: str = "train", flag: str = "--dataset"):
    """The dataset at `path` (module docstring) as a `datasets.Dataset` with a usable `prompt` column."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{flag} needs the `datasets` package: pip install -e '.[experiments]'") from None
    p = Path(path).expanduser()
    try:
        with _quiet_progress():
            if p.is_file():
                if _blank(p):  # datasets' JSON reader fails on it with a bare StopIteration
                    raise DatasetError(f"{flag} {path} is empty (no rows); pass a file with at least one row")
                builder = FILE_BUILDERS.get(p.suffix.lower())
                if builder is None:
                    raise DatasetError(f"{flag} {path}: cannot read a {p.suffix or 'suffix-less'} file; pass a "
                                       f"{', '.join(FILE_BUILDERS)} file or a directory")
                rows = datasets.load_dataset(builder, data_files={split: str(p)}, split=split)
            elif p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()):
                rows = datasets.load_from_disk(str(p))
                if isinstance(rows, datasets.DatasetDict):
                    if split not in rows:
                        raise DatasetError(f"{flag} {path}: no split {split!r} (it has {', '.join(rows)}); pass "
                                           "--dataset-split")
                    rows = rows[split]
            else:
                rows = datasets.load_dataset(str(p) if p.is_dir() else path, split=split)
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets fails in many ways (missing file, bad JSON, no network, ...)
        first = " ".join(str(e).split())[:300]
        where = "" if p.exists() else " (no such file or directory; an id needs the Hub, i.e. a network)"
        raise DatasetError(f"{flag} {path}{where}: datasets could not read it ({type(e).__name__}: {first})") from None
    return check_rows(rows, path, flag)


def _blank(p: Path) -> bool:
    """The file holds nothing but whitespace."""
    with open(p, "rb") as f:
        head = f.read(1 << 16)
    return not head.strip() and p.stat().st_size <= len(head)


def check_rows(rows, path: str, flag: str = "--dataset"):
    """A `prompt` column of strings or of chat-message lists, and at least one row."""
    if rows.num_rows == 0:
        raise DatasetError(f"{flag} {path} has no rows")
    if "prompt" not in rows.column_names:
        raise DatasetError(f"{flag} {path} has no `prompt` column (its columns: {', '.join(rows.column_names)}); "
                           "name the column holding the prompt text or chat messages `prompt`, as TRL does")
    feature = rows.features["prompt"]
    inner = getattr(feature, "feature", None)
    text = getattr(feature, "dtype", None) in ("string", "large_string")
    chat = isinstance(inner, dict) and {"role", "content"} <= set(inner)
    if not (text or chat):
        raise DatasetError(f"{flag} {path}: the `prompt` column holds {feature}, not strings or chat messages "
                           "([{'role': ..., 'content': ...}, ...])")
    return rows


def _conversational(prompt) -> bool:
    return isinstance(prompt, list)


# -- the task -------------------------------------------------------------------------------------------------


@dataclass
class DatasetTask:
    """A dataset's prompts (read in DataOrder by the run) scored by TRL-signature reward functions."""

    tokenizer: object
    rows: object
    """datasets.Dataset with a `prompt` column (check_rows)."""
    rewards: RewardSet
    source: str
    template_kwargs: dict = field(default_factory=dict)
    eval_rows: object = None
    eval_source: str = ""
    name: str = "dataset"
    _cache: dict = field(default_factory=dict, repr=False)
    _eval: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.rows.num_rows

    def _encode(self, rows, i: int, source: str) -> tuple[list[int], Meta]:
        row = rows[i]
        prompt = row["prompt"]
        where = f"{source} row {i}"
        if _conversational(prompt):
            bad = [m for m in prompt if not isinstance(m, dict) or not isinstance(m.get("role"), str)
                   or not isinstance(m.get("content"), str)]
            if not prompt or bad:
                raise DatasetError(f"{where}: `prompt` must be a non-empty list of {{'role': str, 'content': str}} "
                                   f"messages, got {str(bad[0] if bad else prompt)[:200]}")
            try:
                ids = chat_ids(self.tokenizer, prompt, self.template_kwargs)
            except Exception as e:  # noqa: BLE001 - a chat template rejects a conversation in many ways
                raise DatasetError(f"{where}: the chat template cannot render this prompt ({type(e).__name__}: "
                                   f"{' '.join(str(e).split())[:200]})") from None
        elif isinstance(prompt, str) and prompt:
            ids = [int(t) for t in self.tokenizer(text=prompt)["input_ids"]]
        else:
            raise DatasetError(f"{where}: `prompt` is {prompt!r}; give every row a prompt string or chat messages")
        if not ids:
            raise DatasetError(f"{where}: the prompt tokenizes to no tokens")
        columns = {k: v for k, v in row.items() if k not in EXCLUDED_COLUMNS}
        return ids, {"row": i, "prompt": prompt, "columns": columns, "source": source}

    def prompt_at(self, i: int) -> tuple[list[int], Meta]:
        """Row i as (prompt ids, {"row", "prompt", "columns", "source"}), tokenized once."""
        if i not in self._cache:
            self._cache[i] = self._encode(self.rows, i, self.source)
        return self._cache[i]

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        """n rows drawn with `rng` (the Task protocol, for tools that draw that way; simple_rl.py reads the
        dataset in DataOrder)."""
        return [self.prompt_at(rng.randrange(len(self))) for _ in range(n)]

    def score_batch(self, completion_ids: list[list[int]], metas: list[Meta], step: int = 0, cfg=None) -> Scored:
        """Every reward function once over the batch, with TRL's arguments (spirl.tasks.rewards)."""
        prompts = [m["prompt"] for m in metas]
        texts = self.tokenizer.batch_decode([list(c) for c in completion_ids], skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if _conversational(p) else t for p, t in zip(prompts, texts)]
        columns = columns_of(metas)
        state = trainer_state(step, cfg)
        rows = ", ".join(sorted({f"{m['source']} row {m['row']}" for m in metas}))
        where = lambda i: (f"the {len(metas)} samples of step {step} ({rows})" if i is None  # noqa: E731
                           else f"step {step}, sample {i} ({metas[i]['source']} row {metas[i]['row']})")
        return self.rewards(prompts, completions, [list(c) for c in completion_ids], columns, state, where)

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        """One completion's reward, the reward functions called on a batch of one (the Task protocol's
        per-sample reward; NaN when no function applies)."""
        return float(self.score_batch([completion_ids], [meta]).rewards[0])

    def eval_problems(self) -> list[tuple[list[int], Meta]]:
        """--eval-dataset's rows in file order, tokenized once."""
        if self._eval is None:
            self._eval = [self._encode(self.eval_rows, i, self.eval_source) for i in range(self.eval_rows.num_rows)]
        return self._eval


def columns_of(metas: list[Meta]) -> dict[str, list]:
    """The dataset columns besides the prompt, as TRL passes them to reward functions: {column: one value per
    sample}, the first sample's columns naming them; {} for samples of a task that is not a dataset."""
    keys = list(metas[0].get("columns") or {}) if metas else []
    return {k: [m["columns"].get(k) for m in metas] for k in keys}


def parse_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object (empty = none)."""
    if not text:
        return {}
    try:
        out = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"--chat-template-kwargs {text!r} is not JSON ({e.msg}); pass an object such as "
                           "'{\"enable_thinking\": false}'") from None
    if not isinstance(out, dict):
        raise DatasetError(f"--chat-template-kwargs {text!r} is not a JSON object; pass e.g. '{{\"enable_thinking\": false}}'")
    return out


def make(tokenizer, cfg) -> DatasetTask:
    """The task of --dataset, --reward, --reward-weights, --eval-dataset, --chat-template-kwargs."""
    rewards = RewardSet.load(cfg.reward, cfg.reward_weights)
    rows = load_rows(cfg.dataset, cfg.dataset_split)
    task = DatasetTask(tokenizer, rows, rewards, cfg.dataset, parse_template_kwargs(cfg.chat_template_kwargs))
    if cfg.eval_dataset:
        task.eval_rows, task.eval_source = load_rows(cfg.eval_dataset, cfg.dataset_split, "--eval-dataset"), cfg.eval_dataset
    log.info("--dataset %s: %d rows; rewards %s (weights %s)", cfg.dataset, len(task), ", ".join(rewards.names),
             rewards.weights)
    return task
