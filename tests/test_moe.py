"""Qwen3-MoE on the CPU: config reading and refusals, weights both ways, the model against transformers'
Qwen3MoeForCausalLM, the sparse block's backward against float64 finite differences, route comparison, and
GRPO on the native engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import batch_invariant_backward as bib
import weights
import weights_vllm_compat as wvc
from torchtitan_compat import moe
from torchtitan_compat.config import ConfigError, hf_config_for_shape, model_args_from_hf_config
from torchtitan_compat.ops import ReferenceBackend

BE = ReferenceBackend()


def hf_moe(tmp_path: Path, name: str = "hf", **overrides) -> tuple[Path, torch.nn.Module]:
    """A random float32 Qwen3MoeForCausalLM written by transformers' save_pretrained."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
              mlp_only_layers=[0], norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    kw.update(overrides)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).float().eval()
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


def packed_logits(model, ids: torch.Tensor, routes=None) -> torch.Tensor:
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    h = model.hidden_states(ids.reshape(-1), torch.arange(t).repeat(b), cu, routes=routes)
    return bib.linear(h, model.output_weight(), model.backend).view(b, t, -1)


@pytest.mark.parametrize("overrides", [
    {},  # renormalized top-2, layer 0 dense
    {"norm_topk_prob": False},  # transformers' default: the softmax probabilities themselves
    {"decoder_sparse_step": 2, "mlp_only_layers": [], "num_hidden_layers": 4},  # layers 1 and 3 sparse
    {"num_experts_per_tok": 8},  # every expert
])
def test_logits_match_transformers(tmp_path, overrides):
    """Loaded through the entry dense checkpoints use: logits within 1e-4 of transformers' in float32 (both
    compute the same float32 math in other orders: products summed in other trees, the combine in slot order
    against index_add in expert order; seen ~3e-7 against logits of ~0.6)."""
    path, hf = hf_moe(tmp_path, **overrides)
    ours = wvc.load_model(path, backend="reference")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (packed_logits(ours, ids) - hf(ids).logits).abs().max()
    assert diff < 1e-4
    sparse = [i for i in range(hf.config.num_hidden_layers)
              if i not in hf.config.mlp_only_layers and (i + 1) % hf.config.decoder_sparse_step == 0]
    assert [i for i, layer in enumerate(ours.layers) if hasattr(layer, "moe")] == sparse


def test_transformers_routes_are_ours(tmp_path):
    """Per sparse layer, the experts transformers' router picks (its top-k of the float32 softmax) are ours, as
    sets (transformers' torch.topk order of equal values is unspecified)."""
    path, hf = hf_moe(tmp_path)
    ours = wvc.load_model(path, backend="reference")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    seen = {}
    hooks = [hf.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, inp, out, i=i: seen.__setitem__(i, out)) for i in (1, 2)]
    routes = {}
    with torch.no_grad():
        hf(ids)
        packed_logits(ours, ids, routes)
    for h in hooks:
        h.remove()
    for i in (1, 2):
        theirs = seen[i][2] if isinstance(seen[i], tuple) else torch.topk(seen[i].softmax(-1), 2).indices
        assert torch.equal(theirs.sort(-1).values, routes[i].long().sort(-1).values)


def test_weights_round_trip_bit_exact(tmp_path):
    """HF per-expert tensors -> merged [E, 2I, D] / [E, D, I] -> HF: every tensor equal, canonical order."""
    path, _ = hf_moe(tmp_path)
    cfg, hf_sd = weights.load_hf_checkpoint(path)
    args = model_args_from_hf_config(cfg)
    compat = wvc.hf_to_compat(dict(hf_sd), args)
    assert list(compat) == list(wvc.expected_compat_shapes(args))
    gate_up, p = compat["layers.1.moe.experts.gate_up_proj"], "model.layers.1.mlp.experts.3."
    assert torch.equal(gate_up[3, :24], hf_sd[p + "gate_proj.weight"])
    assert torch.equal(gate_up[3, 24:], hf_sd[p + "up_proj.weight"])
    back = wvc.compat_to_hf(compat, args)
    assert list(back) == list(weights.expected_hf_shapes(args))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    part = dict(wvc.compat_part_to_hf({k: v for k, v in compat.items() if k.startswith("layers.2.")}, args))
    assert set(part) == {k for k in hf_sd if k.startswith("model.layers.2.")}


def test_fused_expert_tensors_are_read(tmp_path):
    """A checkpoint holding transformers 5's in-memory fused layout (mlp.experts.gate_up_proj / down_proj) reads
    as the per-expert one."""
    path, hf = hf_moe(tmp_path)
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}  # transformers 5 keeps experts fused in memory
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    again = wvc.read_compat(path)
    cfg, per_expert = weights.load_hf_checkpoint(path)
    assert torch.equal(again["layers.2.moe.experts.down_proj"][5],
                       per_expert["model.layers.2.mlp.experts.5.down_proj.weight"])


def test_random_checkpoint_and_check(tmp_path, capsys):
    out = tmp_path / "tm"
    assert weights.main(["--random", "tiny-moe", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixture of experts: 2 sparse layers, 8 experts of width 64, top-2, renormalized" in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    from transformers import Qwen3MoeForCausalLM

    assert Qwen3MoeForCausalLM.from_pretrained(out).config.mlp_only_layers == [0]  # transformers reads it


def test_param_count_of_qwen3_30b_a3b():
    """The memory plan's count is the model card's 30.5B (the random checkpoint written from this shape had
    30,532,122,624 parameters)."""
    from spirl.core.memory_plan import param_count

    assert param_count(model_args_from_hf_config(hf_config_for_shape("Qwen3-30B-A3B"))) == 30_532_122_624


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 > num_experts=8"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0; it must be a positive integer"),
    ({"mlp_only_layers": [7]}, "layer 7 is not one of the 3 layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0; it must be a positive integer"),
    ({"shared_expert_intermediate_size": 64}, "shared experts are not part of Qwen3-MoE"),
    ({"moe_intermediate_size": None}, "lacks moe_intermediate_size"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "only [\"Qwen3MoeForCausalLM\"] is supported"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0; it must be a number >= 0"),
])
def test_bad_moe_configs_are_refused_in_one_line(change, message):
    cfg = {**hf_config_for_shape("tiny-moe"), **change}
    with pytest.raises(ConfigError) as e:
        model_args_from_hf_config(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_dense_config_with_experts_is_refused():
    cfg = {**hf_config_for_shape("tiny"), "num_experts": 4}
    with pytest.raises(ConfigError, match="mixture of experts needs model_type qwen3_moe"):
        model_args_from_hf_config(cfg)


def test_num_local_experts_alias():
    """transformers 5's save_pretrained writes num_local_experts (its attribute_map of num_experts)."""
    cfg = hf_config_for_shape("tiny-moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert model_args_from_hf_config(cfg).moe_args.num_experts == 8


def test_route_follows_vllm_tie_rule():
    """Equal probabilities go to the lower expert index; slots by descending p; renormalized weights p * (1/S)."""
    z = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    w, ids = BE.moe_route(z, 2, True)
    assert ids.tolist() == [[1, 2]] and ids.dtype == torch.int32
    assert torch.equal(w, torch.tensor([[0.5, 0.5]]))
    w, ids = BE.moe_route(z, 3, False)
    assert ids.tolist() == [[1, 2, 4]]
    assert torch.equal(w, torch.softmax(z, -1)[:, [1, 2, 4]])


@pytest.mark.parametrize("renormalize", [True, False])
def test_backward_against_float64_finite_differences(renormalize):
    """Router GEMM, top-k softmax (renormalized or not) and experts: torch.autograd.gradcheck in float64 (finite
    differences against the analytic backward of moe.RouteFunction and moe.ExpertsFunction)."""
    g = torch.Generator().manual_seed(0)
    x, wg = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(5, 8, generator=g, dtype=torch.float64)
    w13 = torch.randn(5, 8, 8, generator=g, dtype=torch.float64)
    w2 = torch.randn(5, 8, 4, generator=g, dtype=torch.float64)

    def block(x, wg, w13, w2):
        w, ids = moe.route(bib.linear(x, wg, BE), 2, renormalize, BE)
        return moe.experts(x, w13, w2, w, ids, BE)

    assert torch.autograd.gradcheck(block, tuple(t.requires_grad_() for t in (x, wg, w13, w2)))


def test_backward_is_deterministic_and_skips_idle_experts():
    g = torch.Generator().manual_seed(3)
    x, w13, w2 = torch.randn(10, 8, generator=g), torch.randn(6, 8, 8, generator=g), torch.randn(6, 8, 4, generator=g)
    ids = torch.tensor([[0, 1]] * 10, dtype=torch.int32)  # experts 2..5 take nothing
    w = torch.full((10, 2), 0.5)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        moe.experts(leaves[0], leaves[1], leaves[2], leaves[3], ids, BE).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert not grads[0][1][2:].any() and grads[0][1][:2].any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_grouped_backward_matches_the_loop(dtype, tol):
    """The experts' backward as grouped GEMMs (torch._grouped_mm, which the CPU runs group by group) against the
    per-expert loop, same inputs, 16 experts of which 0..3 take no rows. float32: the same products in the same
    precision, norm-wise within 1e-6 (fp32 sums, possibly in other orders). bf16: the grouped GEMMs return V and G
    rounded to bf16 where the loop keeps them in fp32 (ExpertsFunction's docstring), which moves every gradient by
    about one bf16 unit roundoff u = 2^-8: within 1e-2 (2.5 u; measured <= 4.4e-3 here and <= 4.3e-3 at
    Qwen3-30B-A3B's layer shapes, T = 1 and 300). The idle experts' weight gradients are exactly 0 on both paths."""
    g = torch.Generator().manual_seed(5)
    t, d, inter, e, k = 40, 64, 32, 16, 4
    x, dy = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * 0.1).to(dtype)
    z = torch.randn(t, e, generator=g)
    z[:, :4] -= 100
    w, ids = BE.moe_route(z, k, True)
    c1 = BE.moe_experts(x, w13, w2, w, ids)[1]
    loop, grouped = (moe.experts_backward(dy, x, w13, w2, w, ids, c1, BE, grouped=on) for on in (False, True))
    for a, b in zip(loop, grouped):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float((b.double() - a.double()).norm() / a.double().norm()) < tol
    for dweight in (*loop[1:3], *grouped[1:3]):
        assert not dweight[:4].any() and dweight[4:].any()


def test_compare_routes_counts_flips_and_order():
    """A swapped slot is a difference but not a flip; another expert is both; the first is named."""
    from spirl.numerics.parity import compare_routes

    # [3 rows, 2 layers, k 2]; layer 0 dense (zeros, as vLLM returns it)
    engine = torch.tensor([[[0, 0], [1, 2]], [[0, 0], [3, 4]], [[0, 0], [5, 6]]], dtype=torch.uint8)
    trainer = engine.clone()
    trainer[1, 1] = torch.tensor([4, 3])  # order only
    trainer[2, 1] = torch.tensor([5, 7])  # another expert
    r = compare_routes([engine], [trainer], (1,), 8)
    assert (r.compared, r.different, r.flips) == (3, 2, 1)
    assert r.first == (0, 1, 1) and r.first_ids == ([3, 4], [4, 3])
    assert r.load.tolist() == [[0, 1, 1, 1, 1, 1, 0, 1]]  # the trainer's routes: 1 2 | 4 3 | 5 7
    same = compare_routes([engine], [engine.clone()], (1,), 8)
    assert (same.different, same.flips) == (0, 0)


def test_lora_on_the_experts_of_a_moe_with_dense_layers_is_refused():
    from torchtitan_compat.lora import LoRAError, LoRASpec, check_spec

    args = model_args_from_hf_config(hf_config_for_shape("tiny-moe"))
    with pytest.raises(LoRAError, match="--lora-targets attn"):
        check_spec(LoRASpec(4, 8, ("q_proj", "gate_proj")), args)
    check_spec(LoRASpec(4, 8, ("q_proj", "v_proj", "lm_head")), args)


@pytest.mark.slow
def test_grpo_on_tiny_moe_native_engine(tmp_path):
    """Two GRPO steps of the random tiny MoE on the native engine: routes compared every step (all equal), the
    experts' load logged, the checkpoint written; the experts' weights move."""
    import simple_rl

    run = tmp_path / "runs"
    code = simple_rl.main(["--engine", "native", "--model", "random:tiny-moe", "--dtype", "float32", "--task",
                           "synthetic", "--steps", "2", "--lr", "1e-3", "--out-dir", str(run), "--checkpoint-dir",
                           str(tmp_path / "ck"), "--run-name", "m"])
    assert code == 0
    rows = [json.loads(line) for line in (run / "m" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["parity/routes_compared"] > 0 and r["parity/router_flips"] == 0 for r in rows)
    assert all("moe/layer1/load_max_over_mean" in r for r in rows)
    step = tmp_path / "ck" / "m" / "step_000002"
    from safetensors.torch import load_file

    base = wvc.read_compat(tmp_path / "ck" / "models" / "random-tiny-moe")
    trained = load_file(str(step / "model.safetensors"))
    key = "layers.1.moe.experts.gate_up_proj"
    assert not torch.equal(trained[key].float(), base[key].float())


@pytest.mark.slow
def test_moe_resume_and_two_ranks(tmp_path):
    """tiny-moe, full fine-tuning, native engine: a run interrupted after step 1 and resumed (another process)
    writes the uninterrupted run's step-2 checkpoint byte for byte; two gloo ranks under torchrun (FSDP2 shards
    the experts) compare every route with the engine's and train."""
    import hashlib
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    args = ["--engine", "native", "--model", "random:tiny-moe", "--dtype", "float32", "--task", "synthetic",
            "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--lr", "1e-3",
            "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--out-dir", str(tmp_path / "runs")]

    def run(name, *extra, ranks=0):
        cmd = [sys.executable, str(repo / "simple_rl.py")]
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(repo / "simple_rl.py")]
        r = subprocess.run(cmd + args + ["--run-name", name, *extra], capture_output=True, text=True, env=env,
                           timeout=900, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]

    def hashes(step_dir):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step_dir.iterdir())}

    full = run("full", "--steps", "2")
    run("cut", "--steps", "1")
    run("cut", "--steps", "2", "--resume", str(tmp_path / "ck" / "cut"))
    assert hashes(tmp_path / "ck" / "full" / "step_000002") == hashes(tmp_path / "ck" / "cut" / "step_000002")
    two = run("two", "--steps", "2", ranks=2)
    for rows in (full, two):
        assert all(r["parity/routes_compared"] > 0 and r["parity/routes_different"] == 0 for r in rows)
    assert two[0]["parity/routes_compared"] == full[0]["parity/routes_compared"]  # the same samples, split in two


def test_load_balancing_loss_is_transformers(tmp_path):
    """moe.load_balancing_loss on the router logits of every sparse layer equals transformers' Qwen3-MoE
    load_balancing_loss_func (float32 logits, routes taken from transformers' own top-k), value and gradient
    with torch.equal."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(4)
    logits = [torch.randn(20, 8, generator=g, requires_grad=True) for _ in range(3)]
    theirs = load_balancing_loss_func(tuple(logits), 8, 2)
    ids = [torch.topk(torch.softmax(z, -1), 2).indices for z in logits]
    ours = moe.load_balancing_loss(logits, ids, 8)
    assert torch.equal(ours, theirs)
    a = torch.autograd.grad(ours, logits)
    b = torch.autograd.grad(load_balancing_loss_func(tuple(logits), 8, 2), logits)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    balanced = moe.load_balancing_loss([torch.zeros(8, 8)], [torch.arange(16).view(8, 2) % 8], 8)
    assert torch.allclose(balanced, torch.tensor(2.0))  # uniform router, every expert taken equally often: aux = k


def test_router_aux_loss_is_refused_on_a_dense_model(tmp_path):
    """One line on stderr, exit status 2 (a bad flag), before any model is built."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "simple_rl.py"), "--engine",
                        "native", "--model", "random:tiny", "--dtype", "float32", "--task", "synthetic", "--steps", "1",
                        "--router-aux-loss", "1", "--out-dir", str(tmp_path / "r"), "--checkpoint-dir",
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "--router-aux-loss 1 needs a mixture-of-experts model" in r.stderr


@pytest.mark.slow
def test_router_aux_loss_trains_the_router(tmp_path):
    """One step with and without --router-aux-loss 1 from the same start: the routers' weights differ, the loss is
    logged, the samples (and so parity) are the same."""
    import simple_rl
    from safetensors.torch import load_file

    rows = {}
    for aux in ("0", "1"):
        assert simple_rl.main(["--engine", "native", "--model", "random:tiny-moe", "--dtype", "float32", "--task",
                               "synthetic", "--steps", "1", "--prompts-per-step", "2", "--group-size", "4",
                               "--max-new-tokens", "8", "--lr", "1e-2", "--router-aux-loss", aux, "--out-dir",
                               str(tmp_path / "r"), "--checkpoint-dir", str(tmp_path / "ck"), "--run-name",
                               f"aux{aux}"]) == 0
        rows[aux] = json.loads((tmp_path / "r" / f"aux{aux}" / "metrics.jsonl").read_text().splitlines()[0])
    assert rows["1"]["router_aux_loss"] > 0 and "router_aux_loss" not in rows["0"]
    assert rows["1"]["reward_mean"] == rows["0"]["reward_mean"]
    a, b = (load_file(str(tmp_path / "ck" / f"aux{x}" / "step_000001" / "model.safetensors")) for x in "01")
    assert not torch.equal(a["layers.1.moe.router.weight"], b["layers.1.moe.router.weight"])


def test_peft_reads_our_attention_adapter_on_a_moe(tmp_path):
    """An adapter on attn + lm_head of a Qwen3-MoE, written here: PEFT on transformers' Qwen3MoeForCausalLM gives
    our logits (within the MoE logits tolerance above, 1e-4) and far from the base's; weights.py --merge-lora equals
    PEFT's merge_and_unload bit for bit, experts included."""
    path, hf = hf_moe(tmp_path)
    peft_reads_our_adapter(tmp_path, path, hf, "attn,lm_head")


def peft_reads_our_adapter(tmp_path: Path, path: Path, hf, targets: str) -> None:
    """Our LoRA of `targets` on checkpoint `path` (B random: the adapter moves the logits), written as a PEFT
    adapter: PEFT on `hf` gives our logits (1e-4) and not the base's; weights.py --merge-lora equals PEFT's
    merge_and_unload bit for bit."""
    from peft import PeftModel

    from torchtitan_compat.lora import LoRASpec, apply_lora, lora_modules, parse_targets
    from torchtitan_compat.peft_adapter import write_adapter

    spec = LoRASpec(4, 16.0, parse_targets(targets))
    ours = wvc.load_model(path, backend="reference").requires_grad_(False)
    apply_lora(ours, spec, {k: v.detach().clone() for k, v in ours.state_dict().items()}, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            for b in m.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            m.merge()  # the weight the model computes with, W + s B A
    write_adapter(tmp_path / "a", {n: q for n, q in ours.named_parameters() if q.requires_grad}, spec)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = hf(ids).logits
        peft = PeftModel.from_pretrained(hf, str(tmp_path / "a")).eval()
        theirs = peft(ids).logits
        mine = packed_logits(ours, ids)
    assert (mine - theirs).abs().max() < 1e-4 and (base - theirs).abs().max() > 1e-2
    weights.merge_lora(tmp_path / "a", path, tmp_path / "m", device="cpu")
    args = model_args_from_hf_config(weights.load_hf_checkpoint(path)[0])
    merged = weights.load_hf_checkpoint(tmp_path / "m")[1]
    peft_merged = weights.unfuse_experts(dict(peft.merge_and_unload().state_dict()), args)
    assert set(merged) == set(peft_merged)
    assert all(torch.equal(v, peft_merged[k]) for k, v in merged.items())


def test_tinker_api_trains_a_moe(tmp_path, monkeypatch):
    """The Tinker SDK's types on a tiny MoE (native engine): LoRA with train_mlp=False samples, runs
    forward_backward with 0 logprobs different and steps; the default (experts adapted too) is refused on this model,
    whose layer 0 is dense (PEFT cannot express LoRA on its MLP: tests/test_moe_lora.py)."""
    from torchtitan_compat.lora import LoRAError

    monkeypatch.setenv("SPIRL_ENGINE", "native")
    monkeypatch.setenv("SPIRL_TINKER_DIR", str(tmp_path / "tinker"))
    from spirl.tinker import clients

    ckpt = weights.write_random_checkpoint(tmp_path / "tm", "tiny-moe", seed=0, dtype=torch.float32)
    svc = clients.ServiceClient(api_key="ignored", base_url="http://ignored")
    try:
        with pytest.raises(LoRAError, match="train_mlp=False"):
            svc.create_lora_training_client(str(ckpt), rank=4).result()
        tinker_round(svc.create_lora_training_client(str(ckpt), rank=4, train_mlp=False).result())
    finally:
        svc.close()


def tinker_round(client) -> None:
    """A Tinker training client's round: sample 2 completions, forward_backward (PPO) on them with 0 logprobs
    different from the sampler's, one optim_step."""
    from tinker import types

    ids = client.get_tokenizer().encode("Question: what is 2+3?")
    sampler = client.save_weights_and_get_sampling_client().result()
    res = sampler.sample(prompt=types.ModelInput.from_ints(ids), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, seed=1)).result()
    pad = [0.0] * (len(ids) - 1)
    data = [types.Datum(model_input=types.ModelInput.from_ints((ids + s.tokens)[:-1]), loss_fn_inputs={
        "target_tokens": (ids + s.tokens)[1:], "logprobs": pad + s.logprobs,
        "advantages": pad + [1.0 if j else -1.0] * len(s.tokens), "weights": pad + [1.0] * len(s.tokens)})
        for j, s in enumerate(res.sequences)]
    out = client.forward_backward(data, "ppo").result()
    assert out.metrics["parity/tokens_compared:sum"] > 0 and out.metrics["parity/tokens_different:sum"] == 0
    client.optim_step(types.AdamParams(learning_rate=5e-3)).result()


def test_moe_config_picks_the_nearest_tuned_token_count(monkeypatch):
    """vllm_ops.moe_config: the tuned table's config at the nearest token count (ties: the smaller count, as
    vLLM's min over abs picks the first), the pinned config where the GPU has no table; copies, never the table's
    own dicts (the kernel pops keys)."""
    from torchtitan_compat import vllm_ops

    table = {1: {"BLOCK_SIZE_M": 16}, 64: {"BLOCK_SIZE_M": 32}, 4096: {"BLOCK_SIZE_M": 128}}
    monkeypatch.setitem(vllm_ops._TUNED, (128, 768), table)
    monkeypatch.setitem(vllm_ops._TUNED, (8, 32), {})
    assert [vllm_ops.moe_config(t, 128, 768)["BLOCK_SIZE_M"] for t in (1, 20, 40, 64, 2000, 2081, 99999)] == \
        [16, 16, 32, 32, 32, 128, 128]
    vllm_ops.moe_config(1, 128, 768).pop("BLOCK_SIZE_M")
    assert table[1] == {"BLOCK_SIZE_M": 16}
    assert vllm_ops.moe_config(5, 8, 32) == vllm_ops.BATCH_INVARIANT_MOE_CONFIG


def test_bench_moe_config_candidates_and_refusal(monkeypatch, capsys):
    """compare/bench_moe_config.py: the pinned config first, every candidate with BLOCK_K 32 (the tiles it checks
    bit for bit besides vLLM's own); a run outside batch-invariant mode is refused in one line."""
    from compare import bench_moe_config as b
    from torchtitan_compat.vllm_ops import BATCH_INVARIANT_MOE_CONFIG

    tuned = [{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
              "num_stages": 5}]
    cands = b.candidates(tuned, BATCH_INVARIANT_MOE_CONFIG)
    assert cands[0] == BATCH_INVARIANT_MOE_CONFIG and len({b.key(c) for c in cands}) == len(cands)
    assert all(c["BLOCK_SIZE_K"] == 32 for c in cands)
    assert {"16x64x32 g1 w4 s5", "16x64x32 g1 w4 s4"} <= {b.name(c) for c in cands}
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert b.main(["--tokens", "8"]) == 2
    assert "VLLM_BATCH_INVARIANT=1" in capsys.readouterr().err
