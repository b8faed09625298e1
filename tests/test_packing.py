"""Packing a batch for the trainer's forward: the vectorized host code against a per-token
reference written out here, for single-turn samples and multi-turn trajectories."""

import random

import pytest
import torch

from spirl.numerics.samples import Sample
from spirl.numerics.parity import pack_sampled
from spirl.numerics.trajectory import Trajectory
from torchtitan_compat import pack


def reference(seqs):
    """Token by token: row offset+j-1 predicts sampled token j of each sequence."""
    tokens, positions, rows, targets, sizes = [], [], [], [], []
    for s in seqs:
        ids, mask = s.ids, s.loss_mask
        picked = [j for j, m in enumerate(mask) if m]
        rows += [len(tokens) + j - 1 for j in picked]
        targets += [ids[j] for j in picked]
        sizes.append(len(picked))
        positions += list(range(len(ids)))
        tokens += ids
    return tokens, positions, rows, targets, sizes


def trajectory(rng: random.Random) -> Trajectory:
    t = Trajectory.start([rng.randrange(151936) for _ in range(rng.randint(1, 9))])
    for _ in range(rng.randint(0, 4)):
        n = rng.randint(1, 7)
        t.add_turn([rng.randrange(151936) for _ in range(n)], torch.zeros(n))
        if rng.random() < 0.7:
            t.add_env([rng.randrange(151936) for _ in range(rng.randint(1, 5))])
    return t


@pytest.mark.parametrize("seed", range(5))
def test_pack_sampled_matches_the_per_token_reference(seed):
    rng = random.Random(seed)
    seqs = [Sample([rng.randrange(151936) for _ in range(rng.randint(1, 6))],
                   [rng.randrange(151936) for _ in range(rng.randint(0, 9))], torch.empty(0))
            for _ in range(rng.randint(1, 6))]
    seqs += [trajectory(rng) for _ in range(rng.randint(1, 6))]
    rng.shuffle(seqs)
    packed, rows, targets, sizes = pack_sampled(seqs)
    tokens, positions, want_rows, want_targets, want_sizes = reference(seqs)
    assert packed.tokens.tolist() == tokens and packed.tokens.dtype == torch.long
    assert packed.positions.tolist() == positions and packed.positions.dtype == torch.long
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor([len(s.ids) for s in seqs]).cumsum(0).tolist()]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == max(len(s.ids) for s in seqs)
    assert rows.tolist() == want_rows and targets.tolist() == want_targets and sizes == want_sizes
    assert rows.dtype == targets.dtype == torch.long


def test_pack_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one sequence"):
        pack([])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack([[1, 2], []])


class Masked:
    def __init__(self, ids, loss_mask):
        self.ids, self.loss_mask = ids, loss_mask


def test_pack_sampled_refuses_bad_masks():
    with pytest.raises(ValueError, match="sequence 1: loss_mask has 2 entries for 3 tokens"):
        pack_sampled([Masked([1, 2], [False, True]), Masked([1, 2, 3], [False, True])])
    with pytest.raises(ValueError, match="sequence 1: its first token is marked sampled"):
        pack_sampled([Masked([1, 2], [False, True]), Masked([4, 5], [True, True])])
