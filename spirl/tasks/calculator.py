"""Multi-turn calculator environment: 'What is 347*29+18?' with a calculator tool.

The policy may call the tool (Qwen3 format, see spirl.tasks.calculator_tool) and gets its result as a tool
reply; it ends the episode by writing `<answer>N</answer>`. A turn with a malformed call, or with
neither a call nor an answer, gets an error message as the reply and the episode goes on (up to
--max-turns). Reward: 1.0 if the episode ended with an answer equal to the expression's value,
else 0.0.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from ..core.chat_format import ToolChatFormat
from ..core.multiturn import EnvReply, Meta
from ..numerics.trajectory import Trajectory
from .calculator_tool import TOOL_SPEC, ToolError, find_tool_call, run_tool_call

POOL_SIZE = 512
POOL_SEED = 4321
"""The question pool is fixed (independent of the run seed) and tokenized once at start."""
INSTRUCTION = "Use the calculator tool, then give the final answer as <answer>N</answer>."
_ANSWER = re.compile(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>")


def question(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 999)
    return f"{a}*{b}+{c}", a * b + c


def user_message(expression: str) -> dict:
    return {"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}


def final_answer(text: str) -> float | None:
    m = _ANSWER.search(text)
    return float(m.group(1)) if m else None


@dataclass
class CalculatorEnv:
    tokenizer: object
    name: str = "calculator"
    multi_turn: bool = True
    format: ToolChatFormat = field(init=False)
    pool: list[tuple[list[int], Meta]] = field(default_factory=list)

    def __post_init__(self):
        self.format = ToolChatFormat(self.tokenizer, [TOOL_SPEC])
        rng = random.Random(POOL_SEED)
        for _ in range(POOL_SIZE):
            expr, answer = question(rng)
            messages = [user_message(expr)]
            self.pool.append((self.format.prompt_ids(messages), {"answer": answer, "messages": messages}))

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        return [self.pool[rng.randrange(len(self.pool))] for _ in range(n)]

    def text(self, ids: list[int]) -> str:
        """Decoded only to read the turn; what is trained on stays the sampled ids."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def step(self, turn_ids: list[int], meta: Meta) -> EnvReply:
        text = self.text(turn_ids)
        try:
            call = find_tool_call(text)
            if call is not None:
                return EnvReply(run_tool_call(call))
        except ToolError as e:
            return EnvReply(json.dumps({"error": str(e)}), error=str(e))
        if final_answer(text) is not None:
            return EnvReply(None)
        msg = "no tool call and no <answer>N</answer> in this turn: call the calculator or answer"
        return EnvReply(json.dumps({"error": msg}), error=msg)

    def reward(self, traj: Trajectory, meta: Meta) -> float:
        if traj.finish_reason != "answered":
            return 0.0
        return 1.0 if final_answer(self.text(traj.turns[-1])) == meta["answer"] else 0.0


def make(tokenizer) -> CalculatorEnv:
    return CalculatorEnv(tokenizer)
