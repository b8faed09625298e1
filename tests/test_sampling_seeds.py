"""Every sample of a round has a random stream of its own (spirl.core.multiturn.prompt_seeds), whichever rank
draws its prompt. One seed for every prompt of a round drew the same noise for sample j of each prompt: on a
random model (near-uniform logits) their tokens were the same from the second one on."""

from __future__ import annotations

import pytest
import torch

from spirl.core.multiturn import prompt_seeds


def test_seeds_are_distinct_over_the_round_and_do_not_depend_on_the_rank_split():
    group, prompts, base = 8, 12, 2**31 - 40  # near the top: the seeds wrap
    one = prompt_seeds(base, 0, prompts, group)
    ranks = [prompt_seeds(base, r * prompts // 4, prompts // 4, group) for r in range(4)]
    assert [s for share in ranks for s in share] == one
    children = {(s + j) % 2**31 for s in one for j in range(group)}  # vLLM's s, s+1, ... per request
    assert len(children) == prompts * group


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from spirl.engines.native_engine import NativeEngine
    from weights_vllm_compat import load_model

    model = load_model(tiny_ckpt, device=torch.device("cpu"), dtype=torch.float32, backend="reference")
    return NativeEngine(model, (151645,))


def _same_tail_tokens(samples, group):
    """Tokens 2.. (the first sees different prompts) at which sample j of prompt 0 and sample j of prompt 1 agree."""
    return sum(a == b for j in range(group)
               for a, b in zip(samples[j].completion_ids[1:], samples[group + j].completion_ids[1:]))


def test_samples_of_different_prompts_are_not_the_same_draws(engine):
    prompts, group = [[9707, 11, 1879], [3838, 374, 220]], 4
    shared = engine.generate(prompts, n=group, max_tokens=12, temperature=1.0, seed=[7, 7])
    assert _same_tail_tokens(shared, group) > 22  # of 44: the failure this guards against, on this random model
    own = engine.generate(prompts, n=group, max_tokens=12, temperature=1.0, seed=prompt_seeds(7, 0, 2, group))
    assert _same_tail_tokens(own, group) == 0  # independent draws from ~152k tokens: a coincidence is ~3e-4
