"""Multi-turn rollouts: the environment protocol and the episode loop, in token ids.

An environment is a task whose episodes take several policy turns. Each turn the policy
generates until it closes the turn with <|im_end|>; the environment reads that turn and either
ends the episode or answers (a tool result, or an error message for a malformed call); the
answer is tokenized alone (spirl.core.chat_format) and appended; the policy continues from the exact
ids so far. See spirl.numerics.trajectory for the resulting sequence and its loss mask.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

from ..numerics.trajectory import Trajectory

log = logging.getLogger(__name__)
Meta = dict[str, Any]


@dataclass
class EnvReply:
    content: str | None
    """What the environment says next (tokenized as a tool reply); None ends the episode."""
    error: str | None = None
    """Set when the turn was malformed (bad tool call, no answer): `content` then tells the model
    what was wrong, and the episode goes on. Counted in the trajectory's env_errors."""


class Environment(Protocol):
    name: str
    multi_turn: bool
    """Always True: how the trainer tells an environment from a single-turn task."""
    format: Any
    """The spirl.core.chat_format.ToolChatFormat that renders the prompt and tokenizes replies."""

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        """n (prompt token ids, metadata), drawn with `rng` only (reproducible)."""
        ...

    def step(self, turn_ids: list[int], meta: Meta) -> EnvReply:
        """React to one sampled turn (its ids, ending with <|im_end|>)."""
        ...

    def reward(self, traj: Trajectory, meta: Meta) -> float:
        """The episode's reward, checked against what `meta` knows (e.g. the answer)."""
        ...


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """A distinct sampling seed for every (episode, turn) of a step (`episode`: its index among every rank's)."""
    return (seed * 1_000_003 + turn * 100_003 + episode) % (2**31)


def prompt_seeds(seed: int, first: int, count: int, group_size: int) -> list[int]:
    """The sampling seeds of `count` prompts, the first of which is prompt `first` of the round (its index among
    every rank's prompts): prompt p's request of group_size samples gets seed + p x group_size, and vLLM seeds
    its samples s, s+1, ... (VLLMEngine.seeds_children), so every sample of a round has a random stream of its
    own. One seed for every prompt would draw the same noise for sample j of each prompt: the samples of
    different groups would be correlated (on a random model, the same tokens from the second one on). A
    prompt's seeds do not depend on how many ranks share the round."""
    return [(seed + (first + i) * group_size) % (2**31) for i in range(count)]


def run_episodes(engine, env: Environment, prompts: list[tuple[list[int], Meta]], group_size: int,
                 max_turns: int, max_new_tokens: int, temperature: float, seed: int,
                 max_len: int = 4096, first: int = 0, **sampling) -> tuple[list[Trajectory], list[Meta]]:
    """group_size episodes per prompt (prompt-major), each of at most max_turns policy turns.

    Turn 1 samples group_size completions per prompt in one call (as single-turn GRPO does, seeds
    `prompt_seeds`; `first`: the index of prompts[0] among every rank's prompts of the round);
    later turns continue every unfinished episode from its exact ids, one seed per episode.
    An episode ends when the environment says so (finish_reason "answered"), after max_turns
    ("max_turns"), when a turn is cut at max_new_tokens ("length") or stops on a token other than
    <|im_end|> ("eos"), or when another turn would not fit in max_len tokens ("context").
    `sampling`: the engine's other sampling settings (min_p, top_k, top_p)."""
    fmt = env.format
    trajs = [Trajectory.start(p) for p, _ in prompts for _ in range(group_size)]
    metas = [m for _, m in prompts for _ in range(group_size)]
    samples = engine.generate([p for p, _ in prompts], n=group_size, max_tokens=max_new_tokens,
                              temperature=temperature, seed=prompt_seeds(seed, first, len(prompts), group_size),
                              **sampling)
    active = list(range(len(trajs)))
    for turn in range(1, max_turns + 1):
        still = []
        for i, s in zip(active, samples):
            t = trajs[i]
            if s.prompt_ids != t.ids:  # tokens in = the trajectory so far, exactly
                raise RuntimeError(f"episode {i}: the engine was prompted with other ids than the trajectory")
            t.add_turn(s.completion_ids, s.logprobs)
            if not s.completion_ids or s.completion_ids[-1] != fmt.turn_end_id:
                t.finish_reason = "length" if s.finish_reason == "length" else "eos"
                continue
            reply = env.step(s.completion_ids, metas[i])
            if reply.content is None:
                t.finish_reason = "answered"
                continue
            if turn == max_turns:
                t.finish_reason = "max_turns"
                continue
            t.add_env(fmt.reply_ids(reply.content), reply.content)
            t.env_errors += reply.error is not None
            if len(t.ids) + max_new_tokens > max_len:
                t.finish_reason = "context"
                continue
            still.append(i)
        active = still
        if not active:
            break
        seeds = [turn_seed(seed, first * group_size + i, turn) for i in active]
        samples = engine.generate([trajs[i].ids for i in active], n=1, max_tokens=max_new_tokens,
                                  temperature=temperature, seed=seeds, **sampling)
    if hasattr(engine, "rescore"):  # the native engine reports the trainer's own packed logprobs
        engine.rescore(trajs, temperature, sampling.get("min_p", 0.0))
    return trajs, metas


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    n = len(trajs)
    out = {"episode/turns_mean": sum(len(t.turns) for t in trajs) / n,
           "episode/env_errors_mean": sum(t.env_errors for t in trajs) / n,
           "episode/tokens_mean": sum(len(t.ids) for t in trajs) / n}
    for reason in ("answered", "max_turns", "length", "eos", "context"):
        out[f"episode/finish_{reason}"] = sum(t.finish_reason == reason for t in trajs) / n
    return out
