"""The trainer's memory and distribution settings, on the CPU: per-layer optimizer stepping equals
one step, activation checkpointing changes no gradient bit, no reference model without a KL term,
`--logprobs sampling` trains on the distribution that sampled, the engine gets the config's
settings, and checkpoints vLLM cannot serve consistently are refused at start."""

from __future__ import annotations

import json
import math

import pytest
import torch

from spirl.core.config import TrainConfig

from test_rl import _cfg


def test_stepping_layer_groups_one_by_one_is_one_adamw_step():
    from spirl.core.optim import build_adamw, step_with_deltas

    torch.manual_seed(0)
    shapes = {"tok_embeddings.weight": (11, 4), "layers.0.a.weight": (4, 4), "layers.0.b.weight": (4,),
              "layers.1.a.weight": (3, 4), "norm.weight": (4,)}
    a = {k: torch.nn.Parameter(torch.randn(s)) for k, s in shapes.items()}
    b = {k: torch.nn.Parameter(v.detach().clone()) for k, v in a.items()}
    opt_a = build_adamw(a, lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(list(b.values()), lr=1e-2, weight_decay=0.1, foreach=False)
    assert [g["layer"] for g in opt_a.param_groups] == ["tok_embeddings", "layers.0", "layers.1", "norm"]
    for step in range(3):
        grads = {k: torch.randn(s) for k, s in shapes.items()}
        before = {k: v.detach().clone() for k, v in a.items()}
        for params in (a, b):
            for k, p in params.items():
                p.grad = grads[k].clone()
        deltas = step_with_deltas(opt_a)
        opt_b.step()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert len(opt_a.param_groups) == 4
        d0 = math.sqrt(sum(float((a[k].double() - before[k].double()).pow(2).sum()) for k in a if k.startswith("layers.0")))
        assert deltas["weight_delta/layers.0/magnitude"] == pytest.approx(d0, rel=1e-12)
        assert set(deltas) == {f"weight_delta/{g}/{m}" for g in ("tok_embeddings", "layers.0", "layers.1", "norm")
                               for m in ("magnitude", "relative_change")}
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sb for k in sb[i])


def test_activation_checkpointing_changes_no_gradient_bit(tiny_ckpt):
    from spirl.numerics.samples import Sample
    from spirl.numerics.parity import SamplingDist, sampled_logprobs_and_entropy
    from weights_vllm_compat import load_model

    model = load_model(tiny_ckpt, device="cpu", dtype=torch.float32, backend="reference")
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 1000, (3,), generator=g).tolist(),
                      torch.randint(0, 1000, (n,), generator=g).tolist(), torch.empty(0)) for n in (5, 40, 1)]

    def grads(checkpointing):
        model.zero_grad(set_to_none=True)
        model.activation_checkpointing = checkpointing
        lps, ent = sampled_logprobs_and_entropy(model, samples, "cpu", SamplingDist(0.7, 0.05), entropy_grad=True)
        (torch.cat(lps).sum() + torch.cat(ent).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, checkpointed = grads(False), grads(True)
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)


def test_no_reference_model_without_kl(tiny_ckpt, tmp_path):
    from spirl.core.policy import build_policy
    from torchtitan_compat.config import ModelDir

    model = ModelDir.read(tiny_ckpt)
    assert build_policy(model, _cfg(tiny_ckpt, tmp_path, kl_coef=0.0).policy_spec(), torch.device("cpu")).ref is None
    assert build_policy(model, _cfg(tiny_ckpt, tmp_path, kl_coef=0.1).policy_spec(), torch.device("cpu")).ref is not None


def test_sampling_logprobs_are_of_the_distribution_that_sampled(tiny_ckpt, tmp_path):
    """At T = 0.7 with min-p, `--logprobs sampling` compares and trains on log softmax(min_p(z / T)):
    parity holds on every token, the logged entropy is of that distribution, and `raw` gives the
    raw logits' logprobs for the same tokens instead."""
    from spirl.loops.run import train

    hist = train(_cfg(tiny_ckpt, tmp_path, temperature=0.7, min_p=0.05, steps=1, kl_coef=0.0, run_name="samp"))
    assert hist[0]["parity/tokens_different"] == 0 and hist[0]["parity/tokens_compared"] == 2 * 4 * 6
    assert "kl_div" not in hist[0] and hist[0]["loss"] == hist[0]["loss"]
    raw = train(_cfg(tiny_ckpt, tmp_path, temperature=0.7, min_p=0.05, steps=1, kl_coef=0.0, run_name="raw",
                     logprobs="raw"))
    assert raw[0]["parity/tokens_different"] == 0
    # same seed, same samples; the trained logprobs (hence the entropy of the distribution) differ
    assert raw[0]["entropy"] != hist[0]["entropy"]


def test_engine_gets_the_configs_settings(tiny_ckpt, tmp_path, monkeypatch):
    import spirl.engines.vllm_engine as vllm_engine
    from spirl.core import policy as trainer

    built = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda cfg: built.append(cfg) or cfg)
    cfg = TrainConfig(model=str(tiny_ckpt), engine="vllm", gpu_memory_utilization=0.25, eager=1, max_model_len=9000,
                      vllm_sleep=1, logprobs="raw").validate()
    from types import SimpleNamespace

    from spirl.core.distributed import World
    from torchtitan_compat.config import ModelDir

    one, ranks = SimpleNamespace(world=World()), SimpleNamespace(world=World(size=2, sharded=True))
    model = ModelDir.read(tiny_ckpt)
    trainer.build_engine(cfg.policy_spec().engine, model, policy=one)
    cfg2 = TrainConfig(model=str(tiny_ckpt), engine="vllm").validate()
    trainer.build_engine(cfg2.policy_spec().engine, model, policy=one)
    trainer.build_engine(cfg2.policy_spec().engine, model, policy=ranks)
    a, b, c = built
    assert (a.gpu_memory_utilization, a.cuda_graphs, a.max_model_len, a.sleep_between_rollouts, a.logprobs_mode) == \
        (0.25, "none", 9000, True, "raw_logprobs")
    assert (b.cuda_graphs, b.logprobs_mode, b.sleep_between_rollouts) == ("full", "processed_logprobs", False)
    assert (a.external_launcher, b.external_launcher, c.external_launcher) == (False, False, True)  # torchrun
    assert a.model_args is model.args  # the engine checks the args read once, not config.json again


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_building_a_policy_reads_config_json_no_more(tiny_ckpt, monkeypatch, lora):
    """The checkpoint's config.json is read and checked once, by the caller (a ModelDir), then passed
    down: building the policy and its engine, through every loader, reads it no more."""
    import torchtitan_compat.config as config
    from spirl.core.build import build_policy_and_engine
    from spirl.core.spec import EngineSpec, LoRAInit, PolicySpec
    from torchtitan_compat.lora import LoRASpec

    model = config.ModelDir.read(tiny_ckpt)
    reads, real = [], config._read_config_json
    monkeypatch.setattr(config, "_read_config_json", lambda d: reads.append(d) or real(d))
    spec = PolicySpec(model=str(tiny_ckpt), engine=EngineSpec(kind="native", logprobs="raw"), dtype="float32",
                      lora=LoRAInit(LoRASpec(2, 4.0, ("q_proj", "v_proj"))) if lora else None)
    policy, engine = build_policy_and_engine(model, spec, torch.device("cpu"))
    assert reads == [] and policy.model.args == model.args and engine.model is policy.model
    assert len(policy.masters) == (2 * 2 * 2 if lora else len(dict(policy.model.named_parameters())))


@pytest.mark.parametrize("head_dim", [64, 96])
def test_head_dims_vllm_cannot_serve_consistently_are_refused(tmp_path, head_dim):
    from spirl.engines.vllm_engine import check_model_supported
    from torchtitan_compat.config import ConfigError, hf_config_for_shape

    cfg = hf_config_for_shape("tiny")
    cfg["head_dim"] = head_dim
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"head_dim {head_dim} is not supported") as e:
        check_model_supported(str(tmp_path))
    assert "\n" not in str(e.value)
    cfg["head_dim"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    check_model_supported(str(tmp_path))


def test_top_k_top_p_warn_that_training_is_off_policy(tiny_ckpt, tmp_path, caplog):
    from spirl.loops.run import train

    with caplog.at_level("WARNING", logger="spirl.loops"):
        hist = train(_cfg(tiny_ckpt, tmp_path, logprobs="raw", top_k=50, top_p=0.9, steps=1, max_new_tokens=2,
                          kl_coef=0.0, run_name="topk"))
    assert hist[0]["parity/tokens_different"] == 0
    assert any("off-policy" in r.getMessage() for r in caplog.records)
