"""LoRA on a Qwen3-MoE's experts (torchtitan_compat/lora_experts.py) on the CPU: the adapters' gradients against
float64 autograd through the merge, PEFT's format both ways (transformers' Qwen3MoeForCausalLM with PEFT's
`target_parameters`), weights.py --merge-lora against PEFT's merge_and_unload bit for bit, the refusals, and GRPO
with a resumed run on the native engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import weights
import weights_vllm_compat as wvc
from tests.test_moe import hf_moe, packed_logits, peft_reads_our_adapter, tinker_round
from torchtitan_compat import moe
from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config
from torchtitan_compat.lora import LoRAError, LoRASpec, apply_lora, check_spec, lora_modules
from torchtitan_compat.lora_experts import ExpertsDeltaFunction, delta
from torchtitan_compat.ops import ReferenceBackend
from torchtitan_compat.peft_adapter import AdapterError, read_adapter

BE = ReferenceBackend()


def _lora_model(path: Path, spec: LoRASpec, params: dict | None = None):
    ours = wvc.load_model(path, backend="reference").requires_grad_(False)
    apply_lora(ours, spec, {k: v.detach().clone() for k, v in ours.state_dict().items()}, seed=0)
    if params is not None:
        with torch.no_grad():
            for n, p in ours.named_parameters():
                if p.requires_grad:
                    p.copy_(params[n])
            for m in lora_modules(ours).values():
                m.merge()
    return ours


def test_adapter_gradients_match_autograd_through_the_merge():
    """float64, one sparse block (8 experts, top-2, two idle): dA, dB of both expert parameters and dx through
    ExpertsDeltaFunction (W' given, the experts' dW' mapped to the adapters) equal autograd through W + s B A
    computed differentiably (PEFT's einsum), to 1e-10 relative (float64 roundoff of different summation orders)."""
    g = torch.Generator().manual_seed(0)
    e, d, i, r, t, k, s = 8, 16, 12, 3, 10, 2, 0.7
    dt = torch.float64
    x = torch.randn(t, d, generator=g, dtype=dt)
    base = {"gate_up_proj": torch.randn(e, 2 * i, d, generator=g, dtype=dt) * 0.2,
            "down_proj": torch.randn(e, d, i, generator=g, dtype=dt) * 0.2}
    ab = {n: (torch.randn(r * e, w.shape[2], generator=g, dtype=dt), torch.randn(w.shape[1], r * e, generator=g,
                                                                                 dtype=dt) * 0.3)
          for n, w in base.items()}
    z = torch.randn(t, e, generator=g, dtype=dt)
    z[:, 6:] = -30.0  # experts 6 and 7 take no tokens
    wts, ids = moe.route(z, k, True, BE)
    dy = torch.randn(t, d, generator=g, dtype=dt)

    def run(weights_of):
        leaves = {n: (a.clone().requires_grad_(), b.clone().requires_grad_()) for n, (a, b) in ab.items()}
        xx = x.clone().requires_grad_()
        w13, w2 = (weights_of(n, *leaves[n]) for n in ("gate_up_proj", "down_proj"))
        (moe.experts(xx, w13, w2, wts, ids, BE) * dy).sum().backward()
        return [xx.grad] + [p.grad for n in leaves for p in leaves[n]]

    merged = {n: base[n] + delta(a, b, s, e) for n, (a, b) in ab.items()}
    ours = run(lambda n, a, b: ExpertsDeltaFunction.apply(merged[n], a, b, s))
    ref = run(lambda n, a, b: base[n] + delta(a, b, s, e))
    for o, want in zip(ours, ref):
        assert o.dtype == dt and ((o - want).norm() / want.norm()).item() < 1e-10


def test_frozen_experts_get_no_weight_gradient():
    """LoRA on attention only: the experts' backward skips the weight products (dW13 = dW2 = None) and dx is the
    same bits as with them."""
    g = torch.Generator().manual_seed(1)
    x, w13, w2 = torch.randn(6, 16, generator=g), torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12,
                                                                                                    generator=g)
    wts, ids = moe.route(torch.randn(6, 4, generator=g), 2, True, BE)
    dy = torch.randn(6, 16, generator=g)
    _, c1 = BE.moe_experts(x, w13, w2, wts, ids)
    full = moe.experts_backward(dy, x, w13, w2, wts, ids, c1, BE, grouped=False)
    frozen = moe.experts_backward(dy, x, w13, w2, wts, ids, c1, BE, grouped=False, weight_grads=False)
    assert frozen[1] is None and frozen[2] is None and torch.equal(full[0], frozen[0])
    assert torch.equal(full[3], frozen[3])


def test_peft_reads_our_expert_adapter(tmp_path):
    """An adapter on attention, the experts (gate_up_proj, down_proj) and lm_head, written here: its config names
    target_parameters (not gate_proj); PEFT on transformers' Qwen3MoeForCausalLM gives our logits (1e-4) and far
    from the base's; weights.py --merge-lora equals PEFT's merge_and_unload bit for bit, the experts moved."""
    path, hf = hf_moe(tmp_path, mlp_only_layers=[])
    peft_reads_our_adapter(tmp_path, path, hf, "all-linear,lm_head")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert "gate_proj" not in cfg["target_modules"]
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert not torch.equal(weights.load_hf_checkpoint(tmp_path / "m")[1][key], weights.load_hf_checkpoint(path)[1][key])


@pytest.mark.parametrize("params", [
    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],  # PEFT nests by the module's parameter order anyway
    ["mlp.experts.down_proj"],
    ["gate_up_proj"],
])
def test_we_read_a_peft_written_expert_adapter(tmp_path, params):
    """PEFT's own adapter (get_peft_model with target_parameters, random A and B: init_lora_weights=False,
    save_pretrained): read here, our model gives PEFT's logits (1e-4) whatever parameters it adapts."""
    from peft import LoraConfig, get_peft_model

    path, hf = hf_moe(tmp_path, mlp_only_layers=[])
    torch.manual_seed(3)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=params,
                     init_lora_weights=False)
    peft = get_peft_model(hf, cfg).eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(0.1)  # kaiming-sized adapters would swamp the base
    peft.save_pretrained(str(tmp_path / "p"))
    spec, loaded, _ = read_adapter(tmp_path / "p", model_args_from_hf_config(json.loads(
        (path / "config.json").read_text())))
    ours = _lora_model(path, spec, loaded)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = peft(ids).logits
        mine = packed_logits(ours, ids)
        base = peft.get_base_model()
    assert (mine - theirs).abs().max() < 1e-4
    with peft.disable_adapter(), torch.no_grad():
        assert (base(ids).logits - theirs).abs().max() > 1e-3


def test_moe_mlp_targets_refused_in_one_line(tmp_path):
    sparse = model_args_from_hf_config({**hf_config_for_shape("tiny-moe"), "mlp_only_layers": []})
    with pytest.raises(LoRAError, match="name both gate_proj and up_proj"):
        check_spec(LoRASpec(4, 8, ("q_proj", "gate_proj")), sparse)
    check_spec(LoRASpec(4, 8, ("gate_proj", "up_proj")), sparse)
    with_dense = model_args_from_hf_config(hf_config_for_shape("tiny-moe"))  # layer 0 dense (mlp_only_layers)
    with pytest.raises(LoRAError, match=r"dense layers \(0:.*--lora-targets attn,lm_head"):
        check_spec(LoRASpec(4, 8, ("q_proj", "gate_proj", "up_proj", "down_proj")), with_dense)
    check_spec(LoRASpec(4, 8, ("q_proj", "v_proj", "lm_head")), with_dense)


@pytest.mark.parametrize("config, message", [
    (dict(target_modules=["q_proj", "gate_proj", "up_proj"]), "transformers 4's per-expert layout"),
    (dict(target_modules="all-linear"), "PEFT adapts the router there too"),
    (dict(target_modules=["q_proj"], target_parameters=["mlp.gate.weight"]), "not a Qwen3-MoE's expert parameters"),
])
def test_peft_configs_we_cannot_compute_are_refused(tmp_path, config, message):
    from peft import LoraConfig

    from torchtitan_compat.peft_adapter import read_config

    LoraConfig(r=2, lora_alpha=4, **config).save_pretrained(str(tmp_path / "a"))
    sparse = model_args_from_hf_config({**hf_config_for_shape("tiny-moe"), "mlp_only_layers": []})
    with pytest.raises(AdapterError, match=message) as err:
        read_config(tmp_path / "a", sparse)
    assert "\n" not in str(err.value)


def test_target_parameters_on_a_dense_model_are_refused(tmp_path):
    from peft import LoraConfig

    from torchtitan_compat.peft_adapter import read_config

    LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]
               ).save_pretrained(str(tmp_path / "a"))
    with pytest.raises(AdapterError, match="not a Qwen3-MoE's expert parameters"):
        read_config(tmp_path / "a", model_args_from_hf_config(hf_config_for_shape("tiny")))


@pytest.fixture(scope="module")
def expert_lora_runs(tmp_path_factory):
    """tiny-moe with every layer sparse, float32, LoRA on attention, experts and lm_head (KL on, two updates per
    batch), native engine: 2 steps, and a run resumed from step 1."""
    from spirl.core.config import TrainConfig
    from spirl.loops.run import train

    tmp = tmp_path_factory.mktemp("expert_lora")
    ckpt = weights.write_random_checkpoint(tmp / "m", "tiny-moe", dtype=torch.float32,
                                           config={"mlp_only_layers": []})
    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=2,
                prompts_per_step=2, group_size=4, max_new_tokens=6, lr=1e-2, kl_coef=0.1, updates_per_batch=2,
                checkpoint_every=1, lora_rank=4, lora_targets="all-linear,lm_head", out_dir=str(tmp / "runs"),
                checkpoint_dir=str(tmp / "ckpt"), run_name="full")
    full = train(TrainConfig(**base).validate())
    resumed = train(TrainConfig(**{**base, "run_name": "resumed",
                                   "resume": str(tmp / "ckpt" / "full" / "step_000001")}).validate())
    return tmp, full, resumed


def test_grpo_trains_the_experts_adapters_with_parity(expert_lora_runs):
    """Every step: 0 logprobs and 0 routes different; the checkpoint is a PEFT adapter whose expert tensors moved
    (B started at zero); a run resumed from step 1 writes the uninterrupted run's step 2 byte for byte."""
    from safetensors.torch import load_file

    tmp, full, resumed = expert_lora_runs
    for step in full:
        assert step["parity/tokens_compared"] > 0 and step["parity/tokens_different"] == 0
        assert step["parity/routes_compared"] > 0 and step["parity/routes_different"] == 0
    step2 = tmp / "ckpt" / "full" / "step_000002"
    adapter = load_file(str(step2 / "adapter_model.safetensors"))
    for layer in range(3):
        key = f"base_model.model.model.layers.{layer}.mlp.experts"
        assert adapter[f"{key}.base_layer.lora_B.weight"].abs().max() > 0  # gate_up_proj
        assert adapter[f"{key}.lora_B.weight"].abs().max() > 0  # down_proj
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(resumed[0]) == strip(full[1])
    for name in ("adapter_model.safetensors", "optimizer.safetensors", "adapter_config.json"):
        assert (step2 / name).read_bytes() == (tmp / "ckpt" / "resumed" / "step_000002" / name).read_bytes()


def test_tinker_api_trains_the_experts(tmp_path, monkeypatch):
    """The Tinker SDK's types on a tiny MoE whose layers are all sparse (native engine): the default LoRA
    (train_mlp=True: the experts adapted) samples, runs forward_backward with 0 logprobs different, steps, and the
    saved adapter holds the experts' tensors."""
    monkeypatch.setenv("SPIRL_ENGINE", "native")
    monkeypatch.setenv("SPIRL_TINKER_DIR", str(tmp_path / "tinker"))
    from spirl.tinker import clients

    ckpt = weights.write_random_checkpoint(tmp_path / "tm", "tiny-moe", dtype=torch.float32,
                                           config={"mlp_only_layers": []})
    svc = clients.ServiceClient(api_key="ignored", base_url="http://ignored")
    try:
        client = svc.create_lora_training_client(str(ckpt), rank=4).result()
        tinker_round(client)
        assert client.save_weights_for_sampler("s1").result().path
    finally:
        svc.close()
    adapters = list((tmp_path / "tinker").rglob("adapter_config.json"))
    assert adapters and all(json.loads(a.read_text()).get("target_parameters") for a in adapters)
