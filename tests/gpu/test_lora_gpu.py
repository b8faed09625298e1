"""LoRA on real vLLM: every sampled token bitwise equal to the trainer while the engine computes with
the trainer's own merged weights, runs repeat bit for bit, the backward is deterministic, and vLLM's
own LoRA (`LoRARequest`) loads the adapters SPIRL writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def rl(model, tmp_path, name, *flags):
    cmd = [sys.executable, "simple_rl.py", "--model", str(model), "--task", "synthetic", "--steps", "3",
           "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64", "--temperature", "0.8",
           "--lr", "2e-3", "--kl-coef", "0.01", "--checkpoint-every", "0", "--out-dir", str(tmp_path / "runs"),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-name", name, "--gpu-memory-utilization", "0.3", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=["tiny", "q06_tied"])
def lora_runs(request, gpu_tiny_ckpt, gpu_06b_4layer_ckpt, tmp_path_factory):
    """Two identical LoRA runs (rank 8, every linear layer and lm_head; the 0.6B shape ties its
    embeddings, so its head is untied into a tensor of its own in engine and trainer alike)."""
    model = gpu_tiny_ckpt if request.param == "tiny" else gpu_06b_4layer_ckpt
    tmp = tmp_path_factory.mktemp(request.param)
    flags = ["--lora-rank", "8", "--lora-targets", "all-linear,lm_head"]
    return model, tmp, rl(model, tmp, "a", *flags), rl(model, tmp, "b", *flags)


def test_lora_parity_every_step(lora_runs):
    _, _, a, _ = lora_runs
    assert len(a) == 3
    for s in a:
        print({k: s[k] for k in ("parity/tokens_compared", "parity/tokens_different", "time/lora_merge")})
        assert s["parity/tokens_compared"] > 0 and s["parity/tokens_different"] == 0
        assert s["weight_delta/output/magnitude"] > 0  # lm_head's adapter trains


def test_lora_runs_repeat_bit_for_bit(lora_runs):
    from safetensors.torch import load_file

    _, tmp, a, b = lora_runs
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert [strip(s) for s in a] == [strip(s) for s in b]
    x = load_file(str(tmp / "ckpt" / "a" / "step_000003" / "adapter_model.safetensors"))
    y = load_file(str(tmp / "ckpt" / "b" / "step_000003" / "adapter_model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert any(k.endswith("lora_B.weight") and x[k].abs().max() > 0 for k in x)


def test_vllm_lora_request_loads_the_adapter(lora_runs):
    model, tmp, _, _ = lora_runs
    proc = subprocess.run([sys.executable, "-m", "compare.lora_in_vllm", "--model", str(model), "--adapter",
                           str(tmp / "ckpt" / "a" / "step_000003"), "--json", str(tmp / "in_vllm.json")],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0 and json.loads((tmp / "in_vllm.json").read_text())["pass"]


def test_lora_backward_is_bitwise_repeatable_on_gpu(gpu_06b_4layer_ckpt):
    from torchtitan_compat import pack
    from torchtitan_compat.lora import LoRASpec, apply_lora, lora_modules, parse_targets
    from weights_vllm_compat import load_model

    model = load_model(gpu_06b_4layer_ckpt, device="cuda", dtype=torch.bfloat16, backend="vllm").requires_grad_(False)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base["output.weight"] = base["tok_embeddings.weight"]
    apply_lora(model, LoRASpec(16, 32.0, parse_targets("all-linear,lm_head")), base, seed=0,
               head_weight=model.tok_embeddings.weight.detach().clone())
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for m in lora_modules(model).values():
            for b in m.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g, device="cuda") * 0.01)
            m.merge()
    seqs = [torch.randint(0, 151669, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (700, 1500, 9)]
    p = pack(seqs).to("cuda")
    rows, targets = torch.arange(len(p.tokens) - 1, device="cuda"), p.tokens[1:]
    model.activation_checkpointing = True

    def grads():
        lp, ent = model.token_logprobs(p.tokens, p.positions, p.cu_seqlens, p.max_seqlen, rows, targets, 0.7,
                                       entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out = {n: q.grad.clone() for n, q in model.named_parameters() if q.requires_grad}
        model.zero_grad(set_to_none=True)
        return out

    first, second = grads(), grads()
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert all(first[n].abs().max() > 0 for n in first if ".lora_A." in n)
