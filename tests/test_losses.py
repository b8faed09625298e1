"""The loss menu (spirl/loops/loss.py, spirl/core/objectives.py) against its papers' formulas, written out
here independently in float64 the way TRL 1.16's GRPOTrainer._compute_loss writes them (padded [B, T] tensors,
a completion mask, one aggregation per loss type), on hand-made tensors.

Tolerance: SPIRL computes in float32 and the references in float64, over sums of ~20 terms of size ~1, so
values and gradients agree to 2e-6 (x max(1, |value|)), float32 rounding; every case below also differs from
the other loss types by far more than that (checked), so a wrong aggregation cannot pass."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from spirl.loops.loss import LossMenu, grpo_advantages, grpo_loss, sequence_weights

TOL = 2e-6
LENGTHS = [3, 5, 1, 4]
L_MAX = 6  # the longest completion allowed (dr_grpo's constant); the padded batch is 5 wide


def _batch(seed: int = 0):
    """4 sequences of LENGTHS sampled tokens, padded to 5; ratios spread over [0.5, 1.6] so both clips bite."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(LENGTHS), max(LENGTHS)
    mask = torch.tensor([[t < n_i for t in range(width)] for n_i in LENGTHS])
    lp = -torch.rand(n, width, generator=g, dtype=torch.float64) * 2 - 0.05
    old = lp + (torch.rand(n, width, generator=g, dtype=torch.float64) - 0.5) * 1.0
    ref = lp + (torch.rand(n, width, generator=g, dtype=torch.float64) - 0.5) * 0.6
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
    ent = torch.rand(n, width, generator=g, dtype=torch.float64) * 3
    return lp * mask, old * mask, ref * mask, adv, mask, ent * mask


def trl_reference(loss_type, lp, old, ref, adv, mask, ent, eps, eps_high, beta, ent_coef, level="token",
                  truncated=None):
    """TRL 1.16's loss (grpo_trainer.py, _compute_loss), transcribed in float64 for one process and one
    accumulation step, plus SPIRL's entropy term aggregated like the loss. `truncated` [B]: TRL's
    mask_truncated_completions zeroes those rows' completion mask."""
    mask = mask.to(torch.float64)
    if truncated is not None:
        mask = mask * (~torch.tensor(truncated)).unsqueeze(1).to(torch.float64)
    log_ratio = lp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token = per_token + beta * kl - ent_coef * ent
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * L_MAX)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # dapo, bnpo (one micro-batch), cispo


def _ours(loss_type, lp64, old, ref, adv, mask, ent, eps=0.2, eps_high=None, beta=0.05, ent_coef=0.01,
          level="token", truncated=None):
    lp = lp64.float().requires_grad_(True)
    truncated = truncated or [False] * len(LENGTHS)
    w = sequence_weights(loss_type, LENGTHS, truncated, L_MAX, mask_truncated=any(truncated))
    loss, m = grpo_loss(lp, old.float(), ref.float(), adv.float(), mask, eps, beta, ent.float(), ent_coef,
                        LossMenu(loss_type, level, eps_high), w)
    loss.backward()
    return loss, lp.grad, m


def _reference(loss_type, lp64, old, ref, adv, mask, ent, eps=0.2, eps_high=None, beta=0.05, ent_coef=0.01,
               level="token", truncated=None):
    lp = lp64.clone().requires_grad_(True)
    high = eps if eps_high is None else eps_high
    loss = trl_reference(loss_type, lp, old, ref, adv, mask, ent, eps, high, beta, ent_coef, level, truncated)
    loss.backward()
    return loss, lp.grad


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((ours.double() - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))


CASES = [("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("bnpo", {}), ("cispo", {"eps_high": 1.3}),
         ("dapo", {"eps_high": 0.28}),                                    # DAPO's clip-higher
         ("grpo", {"level": "sequence"}),                                 # GSPO
         ("dapo", {"level": "sequence", "eps_high": 0.28}),
         ("grpo", {"truncated": [False, True, False, False]}),           # masked truncated completions
         ("dapo", {"truncated": [False, True, False, True]}),
         ("dr_grpo", {"truncated": [True, False, False, False]}),
         ("cispo", {"eps_high": 1.3, "truncated": [False, False, True, False]})]


@pytest.mark.parametrize("loss_type, kw", CASES, ids=[f"{t}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                       for t, kw in CASES])
def test_loss_equals_the_trl_formula(loss_type, kw):
    batch = _batch()
    loss, grad, m = _ours(loss_type, *batch, **kw)
    ref_loss, ref_grad = _reference(loss_type, *batch, **kw)
    assert _close(loss.detach(), ref_loss.detach()), (float(loss), float(ref_loss))
    assert _close(grad, ref_grad)
    assert math.isfinite(m["pg_loss"]) and 0 <= m["ratio_clipped_frac"] <= 1
    if loss_type in ("grpo", "dr_grpo", "dapo"):  # the aggregations really differ on this batch
        for other in {"grpo", "dr_grpo", "dapo"} - {loss_type}:
            value = trl_reference(other, *batch, 0.2, kw.get("eps_high") or 0.2, 0.05, 0.01, kw.get("level", "token"),
                                  kw.get("truncated"))
            assert abs(float(value) - float(ref_loss.detach())) > 1e3 * TOL, other


def test_the_formulas_by_hand():
    """Two sequences, numbers small enough to check on paper (no KL, no entropy)."""
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.25, 1.0, 1.0]])).requires_grad_(True)  # old = 0: r = e^lp
    old, adv = torch.zeros(2, 3), torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    menu = lambda t, **kw: LossMenu(t, **kw)  # noqa: E731
    w = lambda t: sequence_weights(t, [2, 3], [False, False], 4)  # noqa: E731
    # pg per token (eps 0.2): seq 0 (A=1): -min(1.5, 1.2) = -1.2, -min(0.5, 0.8) = -0.5
    #                          seq 1 (A=-2): -min(-2.5, -2.4) = 2.5, 2, 2
    assert float(grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, menu=menu("grpo"), weights=w("grpo"))[0]) == \
        pytest.approx(((-1.7) / 2 + 6.5 / 3) / 2, abs=1e-6)
    assert float(grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, menu=menu("dapo"), weights=w("dapo"))[0]) == \
        pytest.approx((-1.7 + 6.5) / 5, abs=1e-6)
    assert float(grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, menu=menu("dr_grpo"), weights=w("dr_grpo"))[0]) == \
        pytest.approx((-1.7 + 6.5) / (2 * 4), abs=1e-6)
    # clip-higher 0.28: 1.25 < 1.28 is not clipped for A < 0 anyway; the A > 0 token at 1.5 is clipped to 1.28
    assert float(grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, menu=menu("dapo", clip_high=0.28),
                           weights=w("dapo"))[0]) == pytest.approx((-1.28 - 0.5 + 6.5) / 5, abs=1e-6)
    # cispo, eps_max 1.3: -min(r, 1.3) A logp: seq 0: -(1.3 ln1.5 + 0.5 ln0.5), seq 1: 2 (1.25 ln1.25)
    cispo = -(1.3 * math.log(1.5) + 0.5 * math.log(0.5)) + 2 * 1.25 * math.log(1.25)
    loss, m = grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, menu=menu("cispo", clip_high=1.3), weights=w("cispo"))
    assert float(loss) == pytest.approx(cispo / 5, abs=1e-6)
    assert m["ratio_clipped_frac"] == pytest.approx((1 / 2 + 0 / 3) / 2, abs=1e-7)  # only r=1.5 > 1.3
    loss.backward()  # the clipped weight is a constant: d/dlp = -min(r, 1.3) A / 5
    assert float(lp.grad[0, 0]) == pytest.approx(-1.3 / 5, abs=1e-6)
    assert float(lp.grad[1, 0]) == pytest.approx(2 * 1.25 / 5, abs=1e-6)
    # GSPO: one ratio per sequence, exp(mean log r): seq 0 sqrt(0.75) = 0.866 (A > 0: -0.866), seq 1
    #   1.25^(1/3) = 1.077 (A < 0: 2 x 1.077); neither is clipped, though seq 0's token ratio 1.5 was
    #   (and a token-level grpo loss differs: (-1.7 / 2 + 6.5 / 3) / 2 above)
    s0, s1 = math.sqrt(0.75), 1.25 ** (1 / 3)
    loss, m = grpo_loss(lp.detach(), old, None, adv, mask, 0.2, 0.0, menu=menu("grpo", level="sequence"),
                        weights=w("grpo"))
    assert float(loss) == pytest.approx((-s0 + 2 * s1) / 2, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-6)


def test_micro_batches_and_ranks_sum_to_the_mini_batch():
    """The normalizers span the mini-batch: its loss split over micro-batches (summed), or over 2 ranks
    (each rank's micro-batches, averaged over ranks as FSDP averages gradients), is the one-batch loss."""
    lp, old, ref, adv, mask, ent = (t.float() for t in _batch(1))

    class Ranks:
        """World of rank `rank` of 2 whose all_sum adds the other rank's values (known here)."""

        def __init__(self, rank, mine, other):
            self.rank, self.size, self.sharded, self.mine, self.other = rank, 2, True, mine, other

        def all_sum(self, values):
            return [a + b for a, b in zip(values, self.other)]

    for loss_type in ("grpo", "dr_grpo", "dapo", "cispo"):
        menu = LossMenu(loss_type, "token", 1.3 if loss_type == "cispo" else None)
        trunc = [False, True, False, False]

        def part(rows, world=None, weights_rows=None):
            w = sequence_weights(loss_type, [LENGTHS[i] for i in weights_rows], [trunc[i] for i in weights_rows],
                                 L_MAX, True, world=world)
            idx = [weights_rows.index(i) for i in rows]
            return grpo_loss(lp[rows], old[rows], ref[rows], adv[rows], mask[rows], 0.2, 0.05, ent[rows], 0.01, menu,
                             w[idx[0]:idx[-1] + 1])[0]

        whole = part([0, 1, 2, 3], weights_rows=[0, 1, 2, 3])
        micro = part([0, 1], weights_rows=[0, 1, 2, 3]) + part([2, 3], weights_rows=[0, 1, 2, 3])
        assert abs(float(micro) - float(whole)) <= 1e-6, loss_type
        # rank 0 holds sequences 0, 1 and rank 1 sequences 2, 3: each all_sums (sequences, active tokens)
        counts = lambda rows: [float(len(rows)), float(sum(LENGTHS[i] for i in rows if not trunc[i]))]  # noqa: E731
        r0 = part([0, 1], Ranks(0, None, counts([2, 3])), [0, 1])
        r1 = part([2, 3], Ranks(1, None, counts([0, 1])), [2, 3])
        assert abs(float((r0 + r1) / 2) - float(whole)) <= 1e-6, loss_type


def test_placeholder_sequences_weigh_nothing():
    w = sequence_weights("dapo", [3, 2], [False, False], 4, counted=[True, False])
    assert w.loss.tolist() == [pytest.approx(1 / 3)] + [0.0] and w.mean.tolist() == [pytest.approx(1 / 3), 0.0]
    w = sequence_weights("grpo", [3, 2], [False, False], 4, counted=[True, False])
    assert w.loss.tolist() == [pytest.approx(1 / 3), 0.0]


def _advantages_by_hand(rewards, g, scale):
    """(r - group mean) / (population std + 1e-6), unscorable (None) left out of both, its advantage 0."""
    out, batch = [], [r for r in rewards if r is not None]
    for i in range(0, len(rewards), g):
        group = rewards[i:i + g]
        scorable = [r for r in group if r is not None]
        mean = statistics.fmean(scorable) if scorable else 0.0
        std = {"group": statistics.pstdev(scorable) if scorable else 0.0, "batch": statistics.pstdev(batch)}.get(scale)
        for r in group:
            if r is None:
                out.append(0.0)
            else:
                out.append((r - mean) / (std + 1e-6) if std is not None else r - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_by_scale_rewards(scale):
    rewards = [1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0, None, 1.0, 3.0, None]
    ours = grpo_advantages(torch.tensor([float("nan") if r is None else r for r in rewards]), 4, scale=scale)
    expected = _advantages_by_hand(rewards, 4, scale)
    assert max(abs(a - b) for a, b in zip(ours.tolist(), expected)) <= 1e-5
    assert torch.equal(ours[4:8], torch.zeros(4)) and ours[8] == 0 and ours[11] == 0  # equal group; None -> 0


def test_default_advantages_are_unchanged_bit_for_bit():
    """scale="group" without None rewards is the formula SPIRL always used: (r - mean) / (std + 1e-6)."""
    r = torch.rand(64, generator=torch.Generator().manual_seed(3))
    g = r.view(-1, 8)
    old = ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, unbiased=False, keepdim=True) + 1e-6)).reshape(-1)
    assert torch.equal(grpo_advantages(r, 8), old)


def _trl_advantages(rewards: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer advantages (`_generate_and_score_completions`, multi_objective_aggregation
    "sum_then_normalize"), its lines with its own `nanstd`: the reference for --advantage-std sample."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_sample_std_advantages_are_trls_bit_for_bit(scale, g):
    """--advantage-std sample: TRL's advantages exactly (torch.equal), with unscorable (NaN) rewards, groups of
    equal rewards and groups with one scorable reward (TRL's NaN std -> advantage 0)."""
    gen = torch.Generator().manual_seed(g)
    r = torch.rand(16 * g, generator=gen)
    r[torch.rand(16 * g, generator=gen) < 0.2] = float("nan")
    r[:g] = 0.5  # equal rewards
    r[g:2 * g] = float("nan")
    r[g] = 1.0  # one scorable reward
    ours = grpo_advantages(r, g, scale=scale, std="sample")
    assert torch.equal(ours, _trl_advantages(r, g, scale))
    assert torch.equal(ours[:2 * g], torch.zeros(2 * g))


def test_sample_std_is_larger_by_bessels_factor():
    """Without NaNs the two stds differ by sqrt(G / (G - 1)): the population advantages are that much larger
    (1.155x at G = 4). Tolerance 5e-4 of the ratio: the epsilons differ (1e-6 and 1e-4) against stds of 0.4-0.8,
    a relative 2.5e-4 at most."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 0.0, 1.0, 1.0])
    pop, sample = grpo_advantages(r, 4), grpo_advantages(r, 4, std="sample")
    nonzero = pop != 0  # a reward equal to its group's mean has advantage 0 either way
    assert nonzero.sum() == 6
    assert torch.allclose(pop[nonzero] / sample[nonzero], torch.full((6,), (4 / 3) ** 0.5), rtol=0, atol=5e-4)


def test_loss_menu_reads_the_config():
    cfg = SimpleNamespace(loss_type="cispo", importance_sampling_level="sequence", clip_eps_high=5.0)
    assert LossMenu.from_config(cfg) == LossMenu("cispo", "sequence", 5.0)
    cfg.clip_eps_high = 0.0  # 0 = the same as --clip-eps, TRL's epsilon_high=None
    assert LossMenu.from_config(cfg).clip_high is None
