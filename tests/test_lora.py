"""LoRA on the CPU: the backward against float64, PEFT's format both ways (transformers + peft load
our adapters and agree; our merged export equals PEFT's merge), bit-exact resume, --lora-init, the
memory plan, and one-line errors.

Tolerances (each test says which it uses):
  * float32 vs float64 gradients: 1e-4 of the largest element. Both compute the same sums; float32
    rounds each of K ~ 1e3 products and partial sums (~1e-7 relative each), and the low-rank path
    associates (g^T x) A^T as g^T (x A^T), so element errors reach ~1e-5 relative, not more.
  * float64 vs float64 (our LoRA path vs a reference that materializes W' = W + s B A and lets
    autograd differentiate it): 1e-9 relative: only the association order differs.
  * our model vs transformers + peft: test_model_vs_hf.py's bound, 2e-5 of the largest logit
    + 1e-6 (same float32 math in other op orders), while the adapter moves logits by > 1e-2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batch_invariant_backward as bib
from spirl.core.config import TrainConfig
from torchtitan_compat import pack
from torchtitan_compat.lora import LoRAError, LoRASpec, apply_lora, lora_modules, parse_targets
from torchtitan_compat.ops import ReferenceBackend
from torchtitan_compat.peft_adapter import read_adapter, write_adapter
from weights_vllm_compat import load_model

REPO = Path(__file__).resolve().parents[1]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def lora_model(ckpt, spec: LoRASpec, dtype=torch.float32, seed=0, randomize_b=True):
    """Our model of `ckpt` with LoRA `spec` (own tensors, reference backend) and, with
    `randomize_b`, B drawn at random so the adapters change the output."""
    model = load_model(ckpt, dtype=dtype, backend="reference").requires_grad_(False)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = None
    if "lm_head" in spec.targets and model.output is None:
        base["output.weight"] = base["tok_embeddings.weight"]
        head = model.tok_embeddings.weight.detach().clone()
    apply_lora(model, spec, base, seed=seed, head_weight=head)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in lora_modules(model).values():
            for q in m.parameters():
                if q.requires_grad and dtype == torch.float64:
                    q.data = q.data.to(dtype)
            if randomize_b:
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float64) * 0.02)
            m.merge()
    return model


def sequences(lengths=(7, 33, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 151669, (n,), generator=g).tolist() for n in lengths]


# -- the backward -------------------------------------------------------------------------------------------


def _linear_case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, k, r, scale = 37, 48, 4, 2.5
    rows = (16, 8, 8)
    w = torch.randn(sum(rows), k, generator=g, dtype=torch.float64) * 0.1
    x = torch.randn(t, k, generator=g, dtype=torch.float64)
    ab = []
    for n in rows:
        ab += [torch.randn(r, k, generator=g, dtype=torch.float64) * 0.2, torch.randn(n, r, generator=g,
                                                                                     dtype=torch.float64) * 0.2]
    gy = torch.randn(t, sum(rows), generator=g, dtype=torch.float64)
    slices = [(sum(rows[:i]), n) for i, n in enumerate(rows)]
    return w, x, ab, gy, slices, scale


def _ours(w, x, ab, gy, slices, scale, dtype):
    xs = x.to(dtype).requires_grad_(True)
    ps = [p.to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_(True) for p in ab]
    merged = w.clone()
    for i, (o, n) in enumerate(slices):
        merged[o:o + n] += scale * (ab[2 * i + 1] @ ab[2 * i])
    y = bib.lora_linear(xs, merged.to(dtype), slices, scale, ReferenceBackend(), ps)
    y.backward(gy.to(dtype))
    return y, xs.grad, [p.grad for p in ps]


def _materialized(w, x, ab, gy, slices, scale):
    """float64 autograd through W' = W + s B A, materialized: the reference."""
    xs = x.clone().requires_grad_(True)
    ps = [p.clone().requires_grad_(True) for p in ab]
    merged = torch.cat([w[o:o + n] + scale * (ps[2 * i + 1] @ ps[2 * i]) for i, (o, n) in enumerate(slices)])
    y = xs @ merged.t()
    y.backward(gy)
    return y, xs.grad, [p.grad for p in ps]


def test_lora_linear_backward_matches_float64():
    case = _linear_case()
    y, dx, dps = _ours(*case, dtype=torch.float32)
    y64, dx64, dps64 = _materialized(*case)
    for ours, ref in [(y, y64), (dx, dx64), *zip(dps, dps64)]:
        err = (ours.double() - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), err  # tolerance: module docstring
    # float64 through our Function: the same math, another association only
    _, dx_, dps_ = _ours(*case, dtype=torch.float64)
    for ours, ref in [(dx_, dx64), *zip(dps_, dps64)]:
        assert (ours - ref).abs().max().item() <= 1e-9 * ref.abs().max().item()


def test_lora_linear_backward_is_deterministic():
    case = _linear_case(seed=3)
    _, dx1, d1 = _ours(*case, dtype=torch.float32)
    _, dx2, d2 = _ours(*case, dtype=torch.float32)
    assert torch.equal(dx1, dx2) and all(torch.equal(a, b) for a, b in zip(d1, d2))


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", pytest.param("qwen06_2layer_ckpt", marks=pytest.mark.slow)])
def test_model_gradients_match_materialized_float64(ckpt, request):
    """Every adapter of every module, lm_head included (tied embeddings: an untied head), through
    the whole model and the sampling transform: our low-rank backward vs autograd through a
    materialized W' (float64; tolerance 1e-9 relative, module docstring)."""
    model = lora_model(request.getfixturevalue(ckpt), LoRASpec(4, 8.0, ALL), dtype=torch.float64)
    seqs = sequences()
    p = pack(seqs)
    rows = torch.arange(len(p.tokens) - 1)
    targets = p.tokens[1:]

    def loss():
        lp, ent = model.token_logprobs(p.tokens, p.positions, p.cu_seqlens, p.max_seqlen, rows, targets,
                                       temperature=0.7, entropy=True)
        return lp.sum() + 0.3 * ent.sum()

    loss().backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters() if q.requires_grad}
    model.zero_grad(set_to_none=True)
    assert len(ours) == 2 * (7 * model.args.n_layers + 1)
    for m in lora_modules(model).values():  # the reference: W' as a differentiable function of A, B
        def weight(m=m):
            w = m.weight.detach().clone()
            parts = [w[:m.blocks[0][1]]] if m.blocks[0][1] else []
            for t, o, n in m.blocks:
                parts.append(m.base[t] + m.scale * (m.lora_B[t] @ m.lora_A[t]))
            return torch.cat(parts)
        m.apply = lambda x, backend, weight=weight: bib.linear(x, weight(), backend)
        if "lm_head" in m.lora_A:
            model.output_weight = weight
            model.head_lora = lambda: None
    loss().backward()
    for n, g in ours.items():
        ref = dict(model.named_parameters())[n].grad
        assert (g - ref).abs().max().item() <= 1e-9 * ref.abs().max().item(), n
        assert ref.abs().max().item() > 0, n


# -- PEFT's format, both ways --------------------------------------------------------------------------------


def _hf_logits(model, seqs):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


@pytest.mark.parametrize("ckpt,targets", [("tiny_ckpt", "all-linear,lm_head"), ("qwen06_2layer_ckpt", "attn,lm_head"),
                                          ("tiny_ckpt", "q_proj,v_proj,down_proj")])
def test_peft_loads_our_adapter_and_agrees(ckpt, targets, request, tmp_path):
    """Adapter written here -> peft on transformers' Qwen3 -> the same logits as our model with the
    adapter (test_model_vs_hf.py's tolerance), and far from the base's."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    model_dir = request.getfixturevalue(ckpt)
    spec = LoRASpec(4, 16.0, parse_targets(targets))
    ours = lora_model(model_dir, spec)
    write_adapter(tmp_path, {n: q for n, q in ours.named_parameters() if q.requires_grad}, spec)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
    seqs = sequences()
    p = pack(seqs)
    with torch.no_grad():
        logits = ours(p.tokens, p.positions, p.cu_seqlens, p.max_seqlen)
    ours_logits = [logits[a:b] for a, b in p.spans()]
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    base = _hf_logits(hf, seqs)
    peft = PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    theirs = _hf_logits(peft, seqs)
    scale = max(t.abs().max().item() for t in theirs)
    err = max((o - t).abs().max().item() for o, t in zip(ours_logits, theirs))
    moved = max((b - t).abs().max().item() for b, t in zip(base, theirs))
    print(f"max|Δlogit| ours vs peft {err:.2e}; adapter vs base {moved:.2e}")
    assert err <= 2e-5 * scale + 1e-6
    assert moved > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_export_equals_peft_merge(tiny_ckpt, tmp_path, dtype):
    """weights.py --merge-lora == peft's merge_and_unload, bit for bit (same formula, one rounding),
    for a float32 and a bfloat16 base."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    import weights

    base_dir = tiny_ckpt
    if dtype != torch.float32:
        base_dir = weights.write_random_checkpoint(tmp_path / "bf16", "tiny", seed=0, dtype=dtype)
    spec = LoRASpec(8, 32.0, parse_targets("all-linear,lm_head"))
    ours = lora_model(base_dir, spec)
    write_adapter(tmp_path / "adapter", {n: q for n, q in ours.named_parameters() if q.requires_grad}, spec)
    r = subprocess.run([sys.executable, str(REPO / "weights.py"), "--merge-lora", str(tmp_path / "adapter"),
                        "--model", str(base_dir), "--out", str(tmp_path / "merged"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    _, merged = weights.load_hf_checkpoint(tmp_path / "merged")
    hf = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=dtype)
    theirs = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    assert set(merged) == set(theirs)
    changed = 0
    for k, v in merged.items():
        assert v.dtype == dtype and torch.equal(v, theirs[k]), k
        changed += not torch.equal(v, weights.load_hf_checkpoint(base_dir)[1][k])
    assert changed == 7 * 2 + 1  # every adapted weight of both layers, and lm_head


def test_merged_export_of_a_tied_head_is_untied(qwen06_2layer_ckpt, tmp_path):
    """LoRA on lm_head of a tied model changes the output projection only: the export unties it."""
    import weights

    spec = LoRASpec(4, 8.0, ("q_proj", "lm_head"))
    ours = lora_model(qwen06_2layer_ckpt, spec)
    write_adapter(tmp_path / "a", {n: q for n, q in ours.named_parameters() if q.requires_grad}, spec)
    weights.merge_lora(tmp_path / "a", qwen06_2layer_ckpt, tmp_path / "m", device="cpu")
    cfg, merged = weights.load_hf_checkpoint(tmp_path / "m")
    _, base = weights.load_hf_checkpoint(qwen06_2layer_ckpt)
    assert cfg["tie_word_embeddings"] is False
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(merged["lm_head.weight"], ours.output.weight.detach())
    assert not torch.equal(merged["lm_head.weight"], base["model.embed_tokens.weight"])


def test_read_adapter_written_by_peft(tiny_ckpt, tmp_path):
    """An adapter peft itself made (its default init, target_modules as peft stores them) reads back."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    pm = get_peft_model(hf, cfg)
    pm.save_pretrained(str(tmp_path))
    spec, params, _ = read_adapter(tmp_path, load_model(tiny_ckpt).args)
    assert spec == LoRASpec(2, 4.0, ("q_proj", "v_proj", "up_proj"))
    a = dict(pm.named_parameters())["base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight"]
    assert torch.equal(params["layers.1.feed_forward.gate_up_proj.lora_A.up_proj"], a.detach())


# -- training, resume, --lora-init ---------------------------------------------------------------------------


def _cfg(tiny_ckpt, tmp: Path, **kw) -> TrainConfig:
    base = dict(model=str(tiny_ckpt), engine="native", dtype="float32", device="cpu", task="synthetic",
                steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, lr=1e-2, kl_coef=0.1,
                updates_per_batch=2, max_tokens_per_microbatch=40, checkpoint_every=1, lora_rank=4,
                lora_targets="all-linear,lm_head", out_dir=str(tmp / "runs"), checkpoint_dir=str(tmp / "ckpt"),
                run_name="full")
    return TrainConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def lora_runs(tiny_ckpt, module_dir):
    """A 2-step LoRA run (KL on, 2 updates per batch) and one resumed from its step 1."""
    from spirl.loops.run import train

    full = train(_cfg(tiny_ckpt, module_dir))
    resumed = train(_cfg(tiny_ckpt, module_dir, run_name="resumed",
                         resume=str(module_dir / "ckpt" / "full" / "step_000001")))
    return module_dir, full, resumed


def test_lora_run_trains_adapters_with_parity(lora_runs):
    tmp, full, _ = lora_runs
    step2 = tmp / "ckpt" / "full" / "step_000002"
    assert {p.name for p in step2.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                 "optimizer.safetensors", "state.json"}
    assert not (step2 / "model.safetensors").exists()
    for step in full:
        assert step["parity/tokens_different"] == 0 and step["parity/tokens_compared"] == 2 * 4 * 6
        assert step["weight_delta/layers.0/magnitude"] > 0 and step["weight_delta/output/magnitude"] > 0
        assert "time/lora_merge" in step
    assert full[1]["kl_div"] > 0  # the reference (initial adapters) differs from the trained policy
    from safetensors import safe_open

    with safe_open(str(step2 / "adapter_model.safetensors"), "pt") as f:
        assert "spirl_base_fingerprint" in f.metadata()


def test_lora_resume_matches_uninterrupted(lora_runs):
    from safetensors.torch import load_file

    tmp, full, resumed = lora_runs
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(resumed[0]) == strip(full[1])
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        a = load_file(str(tmp / "ckpt" / "full" / "step_000002" / name))
        b = load_file(str(tmp / "ckpt" / "resumed" / "step_000002" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_init_starts_from_the_adapter(lora_runs, tiny_ckpt):
    from spirl.core.lora import resolve_spec
    from spirl.core.preflight import model_fingerprint
    from spirl.core.build import build_policy_and_engine
    from torchtitan_compat.config import ModelDir

    tmp, _, _ = lora_runs
    adapter = tmp / "ckpt" / "full" / "step_000002"
    cfg = _cfg(tiny_ckpt, tmp, lora_rank=0, lora_targets="", lora_init=str(adapter))
    args = load_model(tiny_ckpt).args
    init = resolve_spec(cfg, args, tiny_ckpt, model_fingerprint(tiny_ckpt))
    assert init.spec.rank == 4 and "lm_head" in init.spec.targets
    policy, _ = build_policy_and_engine(ModelDir.read(tiny_ckpt), cfg.policy_spec(init), torch.device("cpu"))
    _, params, _ = read_adapter(adapter, args)
    assert all(torch.equal(policy.masters[n].detach(), t) for n, t in params.items())
    with pytest.raises(LoRAError, match="contradict"):
        resolve_spec(_cfg(tiny_ckpt, tmp, lora_rank=8, lora_targets="", lora_init=str(adapter)), args, tiny_ckpt)


# -- the memory plan ------------------------------------------------------------------------------------------


def _plan(shape, gib, **kw):
    from spirl.core import memory_plan
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    args = model_args_from_hf_config(hf_config_for_shape(shape))
    cfg = TrainConfig(prompts_per_step=8, group_size=8, max_new_tokens=1024, **kw)
    lora = LoRASpec(cfg.lora_rank, 32.0, parse_targets(cfg.lora_targets)) if cfg.lora_rank else None
    return memory_plan.estimate(args, cfg, gib * 2**30, max_seq_len=1100, logits_chunk_elements=bib.LOGITS_CHUNK_ELEMENTS,
                                lora=lora)


def test_memory_plan_knows_lora():
    assert not _plan("Qwen3-8B", 79.2).fits  # full fine-tuning: 16 bytes a parameter of optimizer state alone
    lora = _plan("Qwen3-8B", 79.2, lora_rank=32)
    assert lora.fits and lora.parts["fp32 masters"] == 0 and lora.parts["compute model"] == 0
    # r (out + in) per module: q 4096+4096, k and v 1024+4096, o 4096+4096, gate and up 12288+4096, down 4096+12288
    assert lora.parts["AdamW state"] == 8 * 32 * 36 * (8192 + 2 * 5120 + 8192 + 3 * 16384)
    on_gpu = _plan("Qwen3-8B", 79.2, lora_rank=32, lora_base="gpu")
    # every adapted fused matrix in bf16: qkv 6144 x 4096, o 4096 x 4096, gate_up 24576 x 4096, down 4096 x 12288
    assert on_gpu.total - lora.total == on_gpu.parts["frozen base"] == 2 * 36 * 4096 * (6144 + 4096 + 24576 + 12288)
    assert _plan("Qwen3-14B", 139.0, lora_rank=32).fits


def test_memory_plan_suggests_lora_when_full_fine_tuning_cannot_fit():
    from spirl.core import memory_plan
    from spirl.core.errors import UserError
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    args = model_args_from_hf_config(hf_config_for_shape("Qwen3-8B"))
    with pytest.raises(UserError, match="or train LoRA \\(--lora-rank\\)"):
        memory_plan.check(args, TrainConfig(), 80 * 2**30)


def test_memory_plan_refuses_a_vllm_share_too_small_for_the_weights():
    from spirl.core import memory_plan
    from spirl.core.errors import UserError
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    args = model_args_from_hf_config(hf_config_for_shape("Qwen3-14B"))
    cfg = TrainConfig(lora_rank=8, gpu_memory_utilization=0.2)
    with pytest.raises(UserError, match="raise it to at least"):
        memory_plan.check(args, cfg, 80 * 2**30, lora=LoRASpec(8, 32.0, parse_targets("")))


# -- one-line errors ------------------------------------------------------------------------------------------


def _simple_rl(tmp_path, *args):
    return subprocess.run([sys.executable, str(REPO / "simple_rl.py"), "--engine", "native", "--dtype", "float32",
                           "--task", "synthetic", "--steps", "1", "--checkpoint-dir", str(tmp_path / "c"),
                           "--out-dir", str(tmp_path / "r"), *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


@pytest.fixture(scope="module")
def other_base_adapter(qwen06_2layer_ckpt, tmp_path_factory):
    """A PEFT adapter for the Qwen3-0.6B shape (not the tiny one)."""
    out = tmp_path_factory.mktemp("other_adapter")
    spec = LoRASpec(4, 8.0, ("q_proj", "v_proj"))
    m = lora_model(qwen06_2layer_ckpt, spec)
    write_adapter(out, {n: q for n, q in m.named_parameters() if q.requires_grad}, spec)
    return out


@pytest.mark.parametrize("flags, status, needle", [
    (["--lora-rank", "-1"], 2, "lora_rank must be >= 1"),
    (["--lora-rank", "129"], 2, "larger than"),
    (["--lora-rank", "4", "--lora-targets", "attn,embed_tokens"], 2, "unknown LoRA target 'embed_tokens'"),
    (["--lora-alpha", "16"], 2, "need --lora-rank"),
    (["--lora-rank", "4", "--engine", "vllm", "--dtype", "bfloat16", "--vllm-sleep", "1"], 2,
     "--vllm-sleep 1 cannot be used with LoRA"),
    (["--lora-init", "OTHER"], 3, "made for another base model"),
    (["--lora-init", "/no/such/adapter"], 3, "no adapter_config.json"),
])
def test_lora_errors_are_one_line(tiny_ckpt, tmp_path, flags, status, needle, other_base_adapter):
    flags = [str(other_base_adapter) if f == "OTHER" else f for f in flags]
    r = _simple_rl(tmp_path, "--model", str(tiny_ckpt), *flags)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status and len(lines) == 1 and needle in lines[0], r.stderr


def test_merge_lora_refuses_an_adapter_for_another_base(tiny_ckpt, other_base_adapter, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "weights.py"), "--merge-lora", str(other_base_adapter), "--model",
                        str(tiny_ckpt), "--out", str(tmp_path / "m")], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "another base model" in lines[0], r.stderr
    assert not (tmp_path / "m").exists()


def test_resume_a_lora_checkpoint_without_lora_is_refused(lora_runs, tiny_ckpt, tmp_path):
    tmp, _, _ = lora_runs
    r = _simple_rl(tmp_path, "--model", str(tiny_ckpt), "--resume", str(tmp / "ckpt" / "full" / "step_000001"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3 and len(lines) == 1 and "is a LoRA checkpoint" in lines[0], r.stderr


def test_unknown_target_in_code():
    with pytest.raises(LoRAError, match="unknown LoRA target"):
        parse_targets("q_proj,qkv_proj")
