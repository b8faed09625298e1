"""The Tinker API on the CPU (native engine, random tiny model): tinker-cookbook's own RL and SL loops
and a plain SDK script, unmodified, through `python -m spirl.tinker`; every loss against a float64
reference of its documented formula; save_state -> load_state bit-exact; the parity check bites;
one-line errors.

Tolerance of the loss checks: float32 vs float64 of the same elementwise formula over 40 tokens:
1e-5 relative to the largest value (float32 rounds each of a few operations per token, ~1e-7 each).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

from spirl.tinker import losses  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "tinker_scripts"


def launch(tmp_path, *args, timeout=900):
    env = {**os.environ, "SPIRL_ENGINE": "native", "SPIRL_TINKER_DIR": str(tmp_path / "tinker"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "spirl.tinker", *map(str, args)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-3000:], r.stderr[-3000:])
    return r


def parity_log(tmp_path) -> list[dict]:
    return [json.loads(x) for f in (tmp_path / "tinker").glob("*/parity.jsonl") for x in f.read_text().splitlines()]


# -- the loss functions, against their documented formulas in float64 ---------------------------------------


def _reference(name, lp, old, adv, w, cfg):
    """Tinker's documented formulas, written out per token in float64."""
    total = 0.0
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    for t in range(len(lp)):
        r = math.exp(lp[t] - old[t])
        if name == "cross_entropy":
            total += -lp[t] * w[t]
        elif name == "importance_sampling":
            total += -r * adv[t]
        elif name == "ppo":
            total += -min(r * adv[t], min(max(r, lo), hi) * adv[t])
        elif name == "cispo":
            total += -min(max(r, lo), hi) * lp[t] * adv[t]
        elif name == "dro":
            total += -(lp[t] * adv[t] - 0.5 * cfg["beta"] * (lp[t] - old[t]) ** 2)
    return total


@pytest.mark.parametrize("name,cfg", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                      ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
                                      ("cispo", {}), ("dro", {"beta": 0.05})])
def test_loss_matches_its_documented_formula(name, cfg):
    g = torch.Generator().manual_seed(0)
    n = 40
    lp64 = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    old64 = lp64 + torch.randn(n, generator=g, dtype=torch.float64) * 0.3  # ratios around 1, some clipped
    adv64 = torch.randn(n, generator=g, dtype=torch.float64)
    w64 = torch.rand(n, generator=g, dtype=torch.float64)
    full = losses.check(name, cfg)
    lp = lp64.float().requires_grad_(True)
    ours = losses.loss(name, lp, {"logprobs": old64.float(), "advantages": adv64.float(), "weights": w64.float()}, full)
    ours.backward()
    ref = _reference(name, lp64.tolist(), old64.tolist(), adv64.tolist(), w64.tolist(), full)
    assert abs(ours.item() - ref) <= 1e-5 * max(1.0, abs(ref))
    # the gradient: central differences of the float64 reference (smooth away from clip boundaries)
    eps = 1e-6
    num = torch.tensor([(_reference(name, (lp64 + eps * torch.eye(n, dtype=torch.float64)[t]).tolist(), old64.tolist(),
                                    adv64.tolist(), w64.tolist(), full)
                         - _reference(name, (lp64 - eps * torch.eye(n, dtype=torch.float64)[t]).tolist(),
                                      old64.tolist(), adv64.tolist(), w64.tolist(), full)) / (2 * eps)
                        for t in range(n)])
    if name == "cispo":  # the clipped ratio is a constant of the gradient (stop-gradient): d/dlp = -clip(r) A
        r = torch.exp(lp64 - old64)
        num = -(r.clamp(full["clip_low_threshold"], full["clip_high_threshold"]) * adv64)
    assert (lp.grad.double() - num).abs().max() <= 1e-4 * max(1.0, num.abs().max().item())


def test_loss_config_errors_are_one_line():
    with pytest.raises(losses.LossError, match="stable_reinforce's objective"):
        losses.check("stable_reinforce", None)
    with pytest.raises(losses.LossError, match="needs loss_fn_config=.'beta'"):
        losses.check("dro", {})
    with pytest.raises(losses.LossError, match="mean nothing to 'importance_sampling'"):
        losses.check("importance_sampling", {"clip_low_threshold": 0.9})
    assert losses.check("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


# -- unmodified clients through `python -m spirl.tinker` -------------------------------------------------------


def test_cookbook_rl_loop_runs_with_parity(tiny_ckpt, tmp_path):
    """tinker_cookbook.rl.train.main, 3 iterations on the arith task as a cookbook Env (compare/tinker_task.py,
    which exits 1 unless every forward_backward compared sampled tokens and none differed)."""
    r = launch(tmp_path, REPO / "compare" / "tinker_task.py", "--model", tiny_ckpt, "--log-path", tmp_path / "cb",
               "--iterations", "3", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0")
    assert r.returncode == 0 and "Training completed successfully" in r.stdout + r.stderr
    calls = [c for c in parity_log(tmp_path) if c["backward"]]
    assert len(calls) == 3 and all(c["tokens_compared"] > 0 and c["tokens_different"] == 0 for c in calls)
    assert [c["version"] for c in calls] == [0, 1, 2]  # on-policy each iteration: one optimizer step between
    assert (tmp_path / "cb" / "checkpoints.jsonl").is_file()


@pytest.mark.slow
def test_cookbook_async_rl_loop_trains_off_policy_data(tiny_ckpt, tmp_path):
    """The cookbook's async mode (AsyncConfig, sampling one step ahead of training, ppo): 4 steps train;
    data sampled at the weights being trained is compared (the first batch always is), data from an
    older sampler is trained as given; nothing differs."""
    r = launch(tmp_path, REPO / "compare" / "tinker_task.py", "--model", tiny_ckpt, "--log-path", tmp_path / "cb",
               "--iterations", "4", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0",
               "--max-steps-off-policy", "1", "--loss-fn", "ppo")
    assert r.returncode == 0 and "Training completed successfully" in r.stdout + r.stderr
    calls = [c for c in parity_log(tmp_path) if c["backward"]]
    assert [c["version"] for c in calls] == [0, 1, 2, 3]
    assert calls[0]["tokens_compared"] > 0 and all(c["tokens_different"] == 0 for c in calls)


@pytest.mark.slow
def test_cookbook_sl_loop_runs(tiny_ckpt, tmp_path):
    r = launch(tmp_path, SCRIPTS / "sl_cookbook.py", tiny_ckpt, tmp_path / "sl")
    assert r.returncode == 0 and "Training completed successfully" in r.stdout + r.stderr
    rows = [json.loads(x) for x in (tmp_path / "sl" / "metrics.jsonl").read_text().splitlines()]
    nll = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(nll) == 3 and nll[-1] < nll[0]  # it trains
    final = json.loads((tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    sampler = Path(str(tmp_path / "tinker") + final["sampler_path"].removeprefix("tinker:/"))
    assert (sampler / "adapter_config.json").is_file() and (sampler / "adapter_model.safetensors").is_file()


def test_plain_sdk_script_runs_with_parity(tiny_ckpt, tmp_path):
    r = launch(tmp_path, SCRIPTS / "rl_quickstart.py", tiny_ckpt)
    assert r.returncode == 0 and "saved tinker://" in r.stdout
    calls = [c for c in parity_log(tmp_path) if c["backward"]]
    assert len(calls) == 2 and all(c["tokens_compared"] > 0 and c["tokens_different"] == 0 for c in calls)


def test_launcher_errors_are_one_line(tmp_path):
    r = launch(tmp_path, tmp_path / "missing.py", timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no script" in r.stderr


# -- in process: resume, the parity check's teeth, errors -----------------------------------------------------


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRL_ENGINE", "native")
    monkeypatch.setenv("SPIRL_TINKER_DIR", str(tmp_path / "tinker"))
    from spirl.tinker import clients

    yield clients
    clients.ServiceClient().close()


def _datums(tok, sampler, n_prompts=2, seed=0):
    from tinker import types

    out = []
    for i in range(n_prompts):
        ids = tok.encode(f"Question {i}: what is {i}+{seed}?")
        res = sampler.sample(prompt=types.ModelInput.from_ints(ids), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=5, seed=seed * 10 + i)).result()
        for j, s in enumerate(res.sequences):
            full = ids + s.tokens
            out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * (len(ids) - 1) + s.logprobs,
                "advantages": [0.0] * (len(ids) - 1) + [1.0 if j else -1.0] * len(s.tokens),
                "weights": [0.0] * (len(ids) - 1) + [1.0] * len(s.tokens)}))
    return out


def _step(client, tok, seed):
    from tinker import types

    sampler = client.save_weights_and_get_sampling_client().result()
    out = client.forward_backward(_datums(tok, sampler, seed=seed), "ppo").result()
    client.optim_step(types.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)).result()
    return out


def test_save_state_then_load_state_is_bit_exact(api, tiny_ckpt):
    svc = api.ServiceClient(api_key="ignored", base_url="http://ignored")
    client = svc.create_lora_training_client(str(tiny_ckpt), rank=4, seed=3).result()
    tok = client.get_tokenizer()
    for step in range(2):
        out = _step(client, tok, step)
        assert out.metrics["parity/tokens_compared:sum"] > 0 and out.metrics["parity/tokens_different:sum"] == 0
    path = client.save_state("two").result().path
    _step(client, tok, 2)
    expected = {n: p.detach().clone() for n, p in client._s.policy.masters.items()}
    svc.close()
    again = api.ServiceClient().create_training_client_from_state_with_optimizer(path).result()
    assert again.get_info().lora_rank == 4
    _step(again, tok, 2)
    got = again._s.policy.masters
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n].detach()) for n in expected)


def test_a_differing_sampler_logprob_stops_forward_backward(api, tiny_ckpt):
    from spirl.numerics.parity import ParityError

    client = api.ServiceClient().create_lora_training_client(str(tiny_ckpt), rank=2).result()
    tok = client.get_tokenizer()
    sampler = client.save_weights_and_get_sampling_client().result()
    data = _datums(tok, sampler)
    rec = next(iter(client._s.sampled.values()))  # what the sampler reported, one ulp off
    rec.logprobs[0] = torch.nextafter(rec.logprobs[0], torch.tensor(0.0))
    with pytest.raises(ParityError, match="different: 1"):
        client.forward_backward(data, "importance_sampling").result()
    assert all(p.grad is None for p in client._s.policy.masters.values())  # nothing of it is applied
    assert list((Path(client._s.cfg.root) / client._s.run_id).glob("parity_failure_*.json"))


def test_old_sampler_keeps_its_weights_and_off_policy_data_trains(api, tiny_ckpt):
    """A sampler made before an optimizer step samples the old weights; its data, now off-policy,
    trains without a parity comparison."""
    from tinker import types

    client = api.ServiceClient().create_lora_training_client(str(tiny_ckpt), rank=2).result()
    tok = client.get_tokenizer()
    old = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("Hello there"))
    before = old.compute_logprobs(prompt).result()
    _step(client, tok, 0)
    assert old.compute_logprobs(prompt).result() == before
    new = client.save_weights_and_get_sampling_client().result()
    assert new.compute_logprobs(prompt).result() != before
    out = client.forward_backward(_datums(tok, old, seed=5), "importance_sampling").result()
    assert out.metrics["parity/tokens_compared:sum"] == 0


def test_api_errors_are_one_line(api, tiny_ckpt, tmp_path):
    svc = api.ServiceClient()
    with pytest.raises(api.APIError, match="rank must be >= 1"):
        svc.create_lora_training_client(str(tiny_ckpt), rank=0)
    with pytest.raises(api.APIError, match="nothing to train"):
        svc.create_lora_training_client(str(tiny_ckpt), train_mlp=False, train_attn=False, train_unembed=False)
    client = svc.create_lora_training_client(str(tiny_ckpt), rank=2).result()
    with pytest.raises(api.APIError, match="one base model per process"):
        svc.create_sampling_client(base_model=str(tmp_path / "other"))
    with pytest.raises(losses.LossError, match="not computed"):
        client.forward_backward([], "gspo").result()


def test_default_lora_client_on_a_tied_model_trains_the_head(api, qwen06_2layer_ckpt):
    """The cookbook's call (the SDK's defaults: train_unembed=True) on a Qwen3 that ties its embeddings:
    lm_head gets its own weight, trains, and parity holds; the input embedding stays the base's."""
    client = api.ServiceClient().create_lora_training_client(str(qwen06_2layer_ckpt), rank=2).result()
    model = client._s.model
    assert model.args.enable_weight_tying and model.output is not None
    embedding = model.tok_embeddings.weight.detach().clone()
    out = _step(client, client.get_tokenizer(), 0)
    assert out.metrics["parity/tokens_compared:sum"] > 0 and out.metrics["parity/tokens_different:sum"] == 0
    assert client._s.policy.masters["output.lora_B.lm_head"].abs().max() > 0
    assert torch.equal(model.tok_embeddings.weight, embedding)
    assert not torch.equal(model.output.weight, embedding)
