"""Speed of the Triton attention backward (kernels/attention_backward.py) against PyTorch's flash
backward and the Python reference backward, at Qwen3-1.7B's attention shape (Hq 16, Hk 8, D 128).

    python compare/bench_attention_backward.py [--sweep] [--shapes 8x1024,2x8192,mixed64]

For each packed batch (8 x 1024, 2 x 8192, 64 sequences of random lengths 32..2048), prints the
median time (triton.testing.do_bench) and TFLOP/s of
  * triton:     `attention_backward` (the three kernels: Delta, dK/dV, dQ), plus a per-kernel split
                from the profiler;
  * torch flash: PyTorch's FlashAttention-2 backward, through `torch.nn.attention.varlen.varlen_attn`
                when this torch has it (the signature is probed: is_causal / window_size, enable_gqa),
                else `scaled_dot_product_attention(is_causal=True)` under the flash backend on a
                padded [B, H, max_len, D] batch (kv heads repeated; its TFLOP/s count only the
                unpadded work). Only the backward is timed (autograd.grad of a saved forward);
  * reference:  `batch_invariant_backward.AttentionFunction.backward` (float32 Python loop), for the
                8 x 1024 batch only.
TFLOP/s count the backward as 2.5x the causal forward: 2.5 * 4 * Hq * D * sum(L^2 / 2).
Then checks the Triton backward: two runs bitwise equal, the first sequence's gradients alone equal
to its rows packed, and (8 x 1024) relative error against the reference.

--sweep also times candidate tile configs (varying the dK/dV half with the dQ half fixed, then the
reverse) so the per-head-dim table in kernels/attention_backward.py can be re-tuned on this GPU.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

HQ, HK, D = 16, 8, 128


def batch_lengths(name: str) -> list[int]:
    if name == "8x1024":
        return [1024] * 8
    if name == "2x8192":
        return [8192] * 2
    if name == "mixed64":
        gen = torch.Generator().manual_seed(0)
        return torch.randint(32, 2049, (64,), generator=gen).tolist()
    raise ValueError(f"unknown shape {name}")


def backward_tflops(lengths: list[int], ms: float) -> float:
    fwd = sum(4 * HQ * D * length * length / 2 for length in lengths)
    return 2.5 * fwd / (ms * 1e-3) / 1e12


def cu_of(lengths: list[int]) -> torch.Tensor:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


def make_inputs(lengths: list[int], seed: int = 0):
    from torchtitan_compat.attention import varlen_causal_attention

    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, h, D, generator=gen, device="cuda").to(torch.bfloat16)
                     for h in (HQ, HK, HK, HQ))
    cu = cu_of(lengths)
    out, lse = varlen_causal_attention(q, k, v, cu, D ** -0.5)  # float32 math; out bf16, lse fp32
    return q, k, v, out, dout, lse, cu


class SavedForward:
    def __init__(self, out, lse):
        self.out, self.lse = out, lse

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale):
        return self.out.to(q.dtype), self.lse.to(q.dtype)


def reference_grads(q, k, v, out, dout, lse, cu):
    import batch_invariant_backward as bib

    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o = bib.attention(qf, kf, vf, cu, 0, D ** -0.5, SavedForward(out.float(), lse))
    return o, (qf, kf, vf), dout.float()


def _short(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def torch_flash_backward(q, k, v, dout, lengths, cu):
    """(label, fn timing one backward, useful-flop fraction) for PyTorch's flash backward, or
    (label, None, reason)."""
    max_len = max(lengths)
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        kw = {}
        kk, vv = k, v
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            kk, vv = (x.repeat_interleave(HQ // HK, dim=1) for x in (k, v))
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        elif "is_causal" in params:
            kw["is_causal"] = True
        else:
            raise RuntimeError(f"varlen_attn has neither window_size nor is_causal: {list(params)}")
        if "scale" in params:
            kw["scale"] = D ** -0.5
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, kk, vv))
        o = varlen_attn(qg, kg, vg, cu, cu, max_len, max_len, **kw)
        inputs = (qg, kg, vg)
        torch.autograd.grad(o, inputs, dout, retain_graph=True)
        return (f"torch varlen_attn ({', '.join(f'{a}={b}' for a, b in kw.items())})",
                lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True), 1.0)
    except Exception as exc:  # noqa: BLE001 - fall back to padded SDPA
        varlen_error = _short(exc)
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b = len(lengths)

        def pad(x):
            padded = x.new_zeros(b, max_len, x.shape[1], D)
            for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                padded[i, :e - s] = x[s:e]
            return padded.transpose(1, 2).repeat_interleave(HQ // x.shape[1], dim=1)  # [B, HQ, L, D]

        qg, kg, vg = (pad(x).detach().requires_grad_() for x in (q, k, v))
        dg = pad(dout)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=D ** -0.5)
        inputs = (qg, kg, vg)
        torch.autograd.grad(o, inputs, dg, retain_graph=True)
        useful = sum(length * length for length in lengths) / (b * max_len * max_len)
        return (f"torch SDPA flash, padded [{b}, {HQ}, {max_len}, {D}] (varlen_attn: {varlen_error})",
                lambda: torch.autograd.grad(o, inputs, dg, retain_graph=True), useful)
    except Exception as exc:  # noqa: BLE001
        return "torch flash", None, f"unavailable (varlen_attn: {varlen_error}; SDPA: {_short(exc)})"


def kernel_split(fn) -> str:
    """Per-kernel GPU time of one call of fn, from the profiler (best effort)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        times = {}
        for evt in prof.key_averages():
            name = evt.key
            for short in ("_preprocess_kernel", "_dkdv_kernel", "_dq_kernel"):
                if short in name:
                    dev_us = getattr(evt, "device_time_total", None)
                    if dev_us is None:
                        dev_us = getattr(evt, "cuda_time_total", 0.0)
                    times[short.strip("_")] = dev_us / 5 / 1e3
        return "  ".join(f"{n} {t:.3f} ms" for n, t in times.items()) or "(no kernel events)"
    except Exception as exc:  # noqa: BLE001
        return f"(profiler unavailable: {type(exc).__name__})"


def sweep_configs():
    from kernels.attention_backward import CONFIGS, AttentionBwdConfig

    base = CONFIGS[D]
    # (block_m, block_n, num_warps, num_stages); the last of each is Triton's fused-attention
    # tutorial's backward (4 warps, 5 stages)
    dkdv = [(32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 1), (64, 128, 8, 2), (16, 128, 8, 3),
            (64, 64, 4, 2), (32, 64, 4, 3), (32, 128, 4, 5)]
    dq = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
          (128, 128, 8, 2), (128, 32, 4, 5)]
    out = []
    for bm, bn, w, s in dkdv:
        out.append(("dkdv", AttentionBwdConfig(bm, bn, w, s, base.block_m2, base.block_n2, base.warps2, base.stages2)))
    for bm, bn, w, s in dq:
        out.append(("dq", AttentionBwdConfig(base.block_m1, base.block_n1, base.warps1, base.stages1, bm, bn, w, s)))
    return out


def bench_shape(shape: str, sweep: bool) -> int:
    """Times and checks one packed batch; returns the number of failed checks."""
    from triton.testing import do_bench

    from kernels.attention_backward import attention_backward

    lengths = batch_lengths(shape)
    max_len = max(lengths)
    scale = D ** -0.5
    q, k, v, out, dout, lse, cu = make_inputs(lengths)
    print(f"\n== {shape}: {len(lengths)} sequences, {sum(lengths)} tokens, max {max_len}")

    def ours(config=None):
        return attention_backward(q, k, v, out, dout, lse, cu, max_len, scale, config=config)

    first = ours()
    ms = do_bench(ours, return_mode="median")
    print(f"  triton      {ms:8.3f} ms  {backward_tflops(lengths, ms):6.1f} TFLOP/s   [{kernel_split(ours)}]")

    label, fn, extra = torch_flash_backward(q, k, v, dout, lengths, cu)
    if fn is None:
        print(f"  torch flash {extra}")
    else:
        ms_t = do_bench(fn, return_mode="median")
        print(f"  torch flash {ms_t:8.3f} ms  {backward_tflops(lengths, ms_t):6.1f} TFLOP/s   "
              f"(ours / theirs = {ms / ms_t:.2f}x; {label}"
              + (f"; useful work {extra:.0%} of padded" if extra < 1 else "") + ")")

    ref_grads = None
    if shape == "8x1024":
        o, inputs, g = reference_grads(q, k, v, out, dout, lse, cu)
        ref_grads = torch.autograd.grad(o, inputs, g, retain_graph=True)
        ms_r = do_bench(lambda: torch.autograd.grad(o, inputs, g, retain_graph=True),
                        return_mode="median", warmup=5, rep=50)
        print(f"  reference   {ms_r:8.3f} ms  {backward_tflops(lengths, ms_r):6.1f} TFLOP/s   "
              f"(float32 Python loop; triton is {ms_r / ms:.1f}x faster)")

    # determinism, batch invariance, accuracy
    again = ours()
    deterministic = all(torch.equal(a, b) for a, b in zip(first, again))
    s, e = int(cu[0]), int(cu[1])
    alone = attention_backward(q[s:e], k[s:e], v[s:e], out[s:e], dout[s:e], lse[:, s:e].contiguous(),
                               cu_of([e - s]), e - s, scale)
    invariant = all(torch.equal(a, b[s:e]) for a, b in zip(alone, first))
    line = f"  checks: two runs bitwise equal {deterministic}; sequence 0 alone == packed {invariant}"
    failures = (not deterministic) + (not invariant)
    if ref_grads is not None:
        errs = [float((a.float() - r).norm() / r.norm()) for a, r in zip(first, ref_grads)]
        line += "; rel. error vs float32 reference " + " ".join(
            f"{n} {err:.2e}" for n, err in zip(("dq", "dk", "dv"), errs))
        failures += any(err > 2e-2 for err in errs)
    print(line)

    if sweep:
        print("  sweep (config: ms, TFLOP/s):")
        for half, cfg in sweep_configs():
            try:
                t = do_bench(lambda cfg=cfg: ours(cfg), return_mode="median")
                print(f"    vary {half:4s} {cfg}: {t:8.3f} ms  {backward_tflops(lengths, t):6.1f} TFLOP/s")
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                print(f"    vary {half:4s} {cfg}: failed ({type(exc).__name__}: {str(exc)[:120]})")
    return failures


def main(argv=None) -> int:
    import triton

    from kernels.attention_backward import CONFIGS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8x1024,2x8192,mixed64")
    p.add_argument("--sweep", action="store_true", help="also time candidate tile configs")
    args = p.parse_args(argv)

    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"Hq {HQ}  Hk {HK}  D {D}  bf16  config {CONFIGS[D]}")
    failures = 0
    for shape in args.shapes.split(","):
        failures += bench_shape(shape, args.sweep)
        torch.cuda.empty_cache()
    print(f"\n{'all checks passed' if failures == 0 else f'{failures} check(s) FAILED'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
