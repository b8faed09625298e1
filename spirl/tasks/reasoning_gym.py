"""`--task reasoning_gym:NAME[,NAME...]`: reasoning-gym's procedural datasets (0.1.25; 106 tasks, generated
offline, no model hub), each scored by its own `score_answer`.

Problems: `reasoning_gym.create_dataset(NAME, size=--task-size, seed=--task-seed)`; several names make
reasoning-gym's `composite` dataset (equal weights, each problem from one of them). The problems do not depend
on --seed; the run reads them in epochs of seeded shuffles like a --dataset (spirl.tasks.dataset.DataOrder).

Prompt: reasoning-gym's own answer format, its `default` system prompt (think step by step, then the answer
inside <answer></answer>), then the question as the user message, through the chat template
(--chat-template-kwargs), tokenized once.

Reward: `dataset.score_answer(extract_answer(completion), entry)`: reasoning-gym's extraction (the last
<answer>...</answer>) and scoring (1.0 for a right answer; some tasks give partial credit). With several
names each has its reward/<NAME> scalar (None, i.e. not applicable, on the other names' problems).

Held-out set (`--eval-every`): EVAL_SIZE problems of the same generator with seed --task-seed + --task-size:
reasoning-gym seeds problem i with seed + i, so these are the problems after the training set's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from . import Meta, TaskError, chat_ids
from .dataset import parse_template_kwargs
from .rewards import RewardError, Scored

SYSTEM_PROMPT = "default"
"""The key of reasoning_gym.utils.SYSTEM_PROMPTS the prompts use."""
EVAL_SIZE = 200
"""Held-out problems (--eval-size N takes the first N)."""
DEFAULT_SIZE, DEFAULT_SEED = 500, 0
"""Without a TrainConfig (tools, tests): reasoning-gym's own default size; a fixed seed."""


def create(names: list[str], size: int, seed: int):
    """reasoning-gym's dataset of `names` (one name: that dataset; several: their composite)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    unknown = [n for n in names if n not in DATASETS]
    if not names or unknown:
        some = ", ".join(sorted(DATASETS)[:8])
        raise TaskError(f"--task reasoning_gym:{','.join(names)}: unknown reasoning-gym dataset "
                        f"{(unknown or [''])[0]!r}; pass names from reasoning_gym.factory.DATASETS ({len(DATASETS)}: "
                        f"{some}, ...)")
    if len(set(names)) != len(names):
        raise TaskError(f"--task reasoning_gym:{','.join(names)} names a dataset twice")
    try:
        if len(names) == 1:
            return reasoning_gym.create_dataset(names[0], size=size, seed=seed)
        from reasoning_gym.composite import DatasetSpec

        return reasoning_gym.create_dataset("composite", size=size, seed=seed,
                                            datasets=[DatasetSpec(n, 1.0, {}) for n in names])
    except (AssertionError, ValueError, TypeError) as e:
        raise TaskError(f"--task reasoning_gym:{','.join(names)} with --task-size {size} --task-seed {seed}: "
                        f"reasoning-gym refused it ({type(e).__name__}: {e})") from None


@dataclass
class ReasoningGymTask:
    tokenizer: object
    names: list[str]
    size: int
    seed: int
    template_kwargs: dict = field(default_factory=dict)
    name: str = "reasoning_gym"
    dataset: object = field(init=False)
    _cache: dict = field(default_factory=dict, repr=False)
    _eval: list | None = field(default=None, repr=False)

    def __post_init__(self):
        self.dataset = create(self.names, self.size, self.seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def _encode(self, entry: dict, index: int) -> tuple[list[int], Meta]:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        messages = [{"role": "system", "content": SYSTEM_PROMPTS[SYSTEM_PROMPT]},
                    {"role": "user", "content": entry["question"]}]
        return chat_ids(self.tokenizer, messages, self.template_kwargs), {"entry": entry, "index": index}

    def prompt_at(self, i: int) -> tuple[list[int], Meta]:
        """Problem i as (prompt ids, {"entry": reasoning-gym's entry, "index": i}), tokenized once."""
        if i not in self._cache:
            self._cache[i] = self._encode(self.dataset[i], i)
        return self._cache[i]

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        """n problems drawn with `rng` (the Task protocol; simple_rl.py reads them in DataOrder)."""
        return [self.prompt_at(rng.randrange(len(self))) for _ in range(n)]

    def score_batch(self, completion_ids: list[list[int]], metas: list[Meta], step: int = 0, cfg=None) -> Scored:
        """Each completion's reasoning-gym score, in the column of its problem's dataset (module docstring)."""
        from reasoning_gym.utils import extract_answer

        texts = self.tokenizer.batch_decode([list(c) for c in completion_ids], skip_special_tokens=True)
        per_name: list[list[float | None]] = [[None] * len(texts) for _ in self.names]
        for i, (text, meta) in enumerate(zip(texts, metas)):
            entry = meta["entry"]
            source = entry["metadata"].get("source_dataset", self.names[0])
            try:
                value = float(self.dataset.score_answer(extract_answer(text), entry))
            except Exception as e:  # noqa: BLE001 - a library's scorer failing is still one line
                raise RewardError(f"reasoning-gym {source}.score_answer raised {type(e).__name__}: {e} on step {step}, "
                                  f"sample {i} (problem {meta['index']})") from e
            per_name[self.names.index(source) if source in self.names else 0][i] = value
        import torch

        per_func = torch.tensor([[float("nan") if v is None else v for v in col] for col in per_name],
                                dtype=torch.float32).T.contiguous()
        return Scored.of_columns(per_func, self.names)

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        """One completion's score (the Task protocol's per-sample reward; batches go through score_batch)."""
        return float(self.score_batch([completion_ids], [meta]).rewards[0])

    def eval_problems(self) -> list[tuple[list[int], Meta]]:
        """EVAL_SIZE problems after the training set's (module docstring), tokenized once."""
        if self._eval is None:
            held_out = create(self.names, EVAL_SIZE, self.seed + self.size)
            self._eval = [self._encode(held_out[i], i) for i in range(EVAL_SIZE)]
        return self._eval


def make(tokenizer, names: str, cfg=None) -> ReasoningGymTask:
    """`--task reasoning_gym:NAMES` with --task-size, --task-seed, --chat-template-kwargs from `cfg`."""
    size = getattr(cfg, "task_size", DEFAULT_SIZE)
    seed = getattr(cfg, "task_seed", DEFAULT_SEED)
    kwargs = parse_template_kwargs(getattr(cfg, "chat_template_kwargs", ""))
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise TaskError("--task reasoning_gym:... needs the reasoning-gym package: pip install -e '.[experiments]'") from None
    return ReasoningGymTask(tokenizer, [n.strip() for n in names.split(",") if n.strip()], size, seed, kwargs)
