"""spirl/numerics/localize.py: capturing per-op activations and finding the first bitwise divergence (CPU).

Three parts:
* `localize` on synthetic captures, where the right answer is known by construction;
* `capture_ours` on a real tiny `Qwen3VLLMCompatModel` (bf16, reference backend), including a
  "has teeth" check that a change in one kernel is pinned to that kernel's op;
* `capture_vllm` on a small stand-in for vLLM's module tree that follows the conventions of
  docs/vllm-0.26-forward-path.md section 11 (tuple outputs, fused norms and rotary that overwrite
  tensors in place, one shared rotary module, logits for the last row only), computing the same
  math as our model, so that the two captures must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spirl.numerics.localize import (
    LAYER_OPS, canonical_names, capture_ours, capture_vllm, localize,
)
from torchtitan_compat import Qwen3VLLMCompatModel, hf_config_for_shape, model_args_from_hf_config, pack
from torchtitan_compat.ops import ReferenceBackend

# --------------------------------------------------------------------------------------------
# Synthetic captures
# --------------------------------------------------------------------------------------------

T, HID, HQ, HKV, D, INTER, VOCAB, N_LAYERS = 6, 8, 2, 1, 4, 12, 20, 3


def synthetic_shapes() -> dict[str, tuple[int, ...]]:
    per_op = {
        "input_norm": (T, HID), "qkv_proj": (T, (HQ + 2 * HKV) * D), "q_norm": (T, HQ, D),
        "k_norm": (T, HKV, D), "rotary_q": (T, HQ, D), "rotary_k": (T, HKV, D), "attn": (T, HQ * D),
        "o_proj": (T, HID), "post_attn_norm": (T, HID), "gate_up_proj": (T, 2 * INTER),
        "act": (T, INTER), "down_proj": (T, HID),
    }
    shapes = {"embed": (T, HID), "final_norm": (T, HID), "logits": (T, VOCAB)}
    for i in range(N_LAYERS):
        shapes.update({f"layers.{i}.{op}": s for op, s in per_op.items()})
    return shapes


def synthetic_capture(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in synthetic_shapes().items()}


def clone_all(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.items()}


def bump_one_ulp(t: torch.Tensor, row: int, col: int) -> None:
    """Add one unit in the last place to t[row, col] (bf16), in place, via its bit pattern."""
    t.view(torch.int16)[row, col] += 1


def test_canonical_order():
    names = canonical_names(2)
    assert names[0] == "embed" and names[-2:] == ["final_norm", "logits"]
    assert names[1:13] == [f"layers.0.{op}" for op in LAYER_OPS]
    assert len(names) == 3 + 2 * len(LAYER_OPS)


def test_identical_captures_report_no_divergence():
    ours = synthetic_capture()
    report = localize(ours, clone_all(ours))
    assert report.first_divergence is None
    assert len(report.comparisons) == len(ours)
    assert not (report.missing_in_ours or report.missing_in_theirs or report.mismatches)
    assert f"no divergence in {len(ours)} captured tensors" in report.format()


def test_first_divergence_is_the_earliest_differing_op():
    ours = synthetic_capture()
    theirs = clone_all(ours)
    row, col = 4, 3
    # One bf16 ulp in layers.1.o_proj, then larger errors in everything downstream of it.
    bump_one_ulp(theirs["layers.1.o_proj"], row, col)
    ulp = (theirs["layers.1.o_proj"][row, col].float() - ours["layers.1.o_proj"][row, col].float()).abs()
    names = canonical_names(N_LAYERS)
    for name in names[names.index("layers.1.o_proj") + 1:]:
        theirs[name][row:] += 0.5  # the error spreads to this and later tokens only (causal)

    report = localize(ours, theirs)
    first = report.first_divergence
    assert first.name == "layers.1.o_proj"
    assert first.first_diff_token == row
    assert first.n_diff == 1
    assert first.max_abs_diff == pytest.approx(float(ulp), rel=0, abs=0)
    assert 0 < first.max_abs_diff < 0.1  # a single ulp of a ~N(0,1) value

    # Earlier layers are clean; the per-layer table shows where and how much.
    by_group = dict(report.groups())
    assert all(c.equal for c in by_group["embed"] + by_group["layer 0"])
    text = report.format()
    assert "first divergence: layers.1.o_proj" in text
    assert f"first differing token {row}" in text
    layer1_line = next(line for line in text.splitlines() if line.startswith("layer 1 "))
    assert "o_proj, post_attn_norm" in layer1_line and "q_norm" not in layer1_line


def test_missing_names_and_shape_mismatch_are_reported_not_raised():
    ours = synthetic_capture()
    theirs = clone_all(ours)
    del theirs["layers.2.act"]
    del ours["layers.0.rotary_k"]
    theirs["layers.0.qkv_proj"] = theirs["layers.0.qkv_proj"][:-1]  # one token short

    report = localize(ours, theirs)
    assert report.missing_in_theirs == ["layers.2.act"]
    assert report.missing_in_ours == ["layers.0.rotary_k"]
    assert len(report.mismatches) == 1 and "layers.0.qkv_proj" in report.mismatches[0]
    assert "(6, 16) vs vLLM (5, 16)" in report.mismatches[0]
    assert report.first_divergence is None  # everything that could be compared is equal
    text = report.format()
    assert "missing in vLLM: layers.2.act" in text and "missing in ours: layers.0.rotary_k" in text
    assert "not compared: layers.0.qkv_proj" in text


def test_logits_compared_on_the_last_rows_vllm_has():
    ours = synthetic_capture()
    theirs = clone_all(ours)
    theirs["logits"] = ours["logits"][-1:].clone()  # vLLM: the sampled row only
    report = localize(ours, theirs)
    assert report.first_divergence is None and not report.mismatches

    theirs["logits"][0, 7] += 1.0
    first = localize(ours, theirs).first_divergence
    assert first.name == "logits" and first.first_diff_token == T - 1  # token index in ours
    assert "last 1 row(s) compared" in first.note


def test_negative_zero_counts_as_a_bitwise_difference():
    ours = {"embed": torch.zeros(2, 3, dtype=torch.bfloat16)}
    theirs = {"embed": -torch.zeros(2, 3, dtype=torch.bfloat16)}
    first = localize(ours, theirs).first_divergence
    assert first.name == "embed" and first.n_diff == 6 and first.max_abs_diff == 0.0


# --------------------------------------------------------------------------------------------
# capture_ours on a real tiny model
# --------------------------------------------------------------------------------------------

SEQUENCES = [[5, 17, 256, 3, 999, 42, 7], [11, 12, 13, 14, 15]]


def tiny_model() -> Qwen3VLLMCompatModel:
    cfg = hf_config_for_shape("tiny")
    cfg["vocab_size"] = 1000  # keeps the lm_head small: this test is about plumbing, not the vocab
    torch.manual_seed(0)
    return Qwen3VLLMCompatModel(model_args_from_hf_config(cfg), backend="reference").to(torch.bfloat16).eval()


def expected_shapes(model, n_tokens: int) -> dict[str, tuple[int, ...]]:
    a = model.args
    per_op = {
        "input_norm": (n_tokens, a.dim), "qkv_proj": (n_tokens, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim),
        "q_norm": (n_tokens, a.n_heads, a.head_dim), "k_norm": (n_tokens, a.n_kv_heads, a.head_dim),
        "rotary_q": (n_tokens, a.n_heads, a.head_dim), "rotary_k": (n_tokens, a.n_kv_heads, a.head_dim),
        "attn": (n_tokens, a.n_heads * a.head_dim), "o_proj": (n_tokens, a.dim),
        "post_attn_norm": (n_tokens, a.dim), "gate_up_proj": (n_tokens, 2 * a.hidden_dim),
        "act": (n_tokens, a.hidden_dim), "down_proj": (n_tokens, a.dim),
    }
    shapes = {"embed": (n_tokens, a.dim), "final_norm": (n_tokens, a.dim), "logits": (n_tokens, a.vocab_size)}
    for i in range(a.n_layers):
        shapes.update({f"layers.{i}.{op}": s for op, s in per_op.items()})
    return shapes


def capture(model, p):
    return capture_ours(model, p.tokens, p.positions, p.cu_seqlens)


def all_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_capture_ours_names_shapes_and_outputs():
    model, p = tiny_model(), pack(SEQUENCES)
    backend = model.backend
    ours = capture(model, p)

    want = expected_shapes(model, p.tokens.numel())
    assert list(ours) == [n for n in canonical_names(model.args.n_layers) if n in ours]  # forward order
    assert {n: tuple(t.shape) for n, t in ours.items()} == want
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ours.values())

    with torch.no_grad():
        logits = model(p.tokens, p.positions, p.cu_seqlens)
        hidden = model.hidden_states(p.tokens, p.positions, p.cu_seqlens)
    assert torch.equal(ours["logits"], logits)
    assert torch.equal(ours["final_norm"], hidden)
    # Rotary really rotated (position 0 is the identity, later positions are not).
    assert not torch.equal(ours["layers.0.rotary_q"], ours["layers.0.q_norm"])

    # The model is left untouched: no hooks, its own backend back in place.
    assert model.backend is backend and all_hooks(model) == 0


def test_capture_ours_twice_is_bitwise_identical():
    model, p = tiny_model(), pack(SEQUENCES)
    report = localize(capture(model, p), capture(model, p))
    assert report.first_divergence is None and len(report.comparisons) == len(expected_shapes(model, p.tokens.numel()))


def test_localize_pins_a_changed_kernel_to_its_op(monkeypatch):
    """Has teeth: a silu_and_mul that rounds once (float32 product) instead of twice must show up
    as layers.0.act, with everything before it in layer 0 still bit-identical."""
    model, p = tiny_model(), pack(SEQUENCES)
    before = capture(model, p)

    def silu_and_mul_fp32(self, x):
        d = x.shape[-1] // 2
        return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)

    monkeypatch.setattr(ReferenceBackend, "silu_and_mul", silu_and_mul_fp32)
    report = localize(before, capture(model, p))
    assert report.first_divergence is not None
    assert report.first_divergence.name == "layers.0.act"
    assert "first divergence: layers.0.act" in report.format()


# --------------------------------------------------------------------------------------------
# capture_vllm on a stand-in with vLLM's module names and in-place conventions
# --------------------------------------------------------------------------------------------

REF = ReferenceBackend()


class FakeLinear(nn.Module):
    """vLLM linears return (out, None)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return REF.linear(x, self.weight), None


class FakeRMSNorm(nn.Module):
    """vLLM's RMSNorm: plain for the first norm; with a residual it behaves like the fused
    add+norm kernel, overwriting both inputs in place, which is why hooks must clone."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x, residual=None):
        if residual is None:
            return REF.rms_norm(x, self.weight, self.eps)
        residual.add_(x)
        x.copy_(REF.rms_norm(residual, self.weight, self.eps))
        return x, residual


class FakeRotary(nn.Module):
    """One module shared by all layers; rotates flat q [T, H*D] and k in place, returns them."""

    def __init__(self, cache, head_dim):
        super().__init__()
        self.cache, self.head_dim = cache, head_dim

    def forward(self, positions, q, k):
        qh, kh = q.view(q.shape[0], -1, self.head_dim), k.view(k.shape[0], -1, self.head_dim)
        q_rot, k_rot = REF.rotary(positions, qh, kh, self.cache)
        qh.copy_(q_rot)
        kh.copy_(k_rot)
        return q, k


class FakeAttn(nn.Module):
    def __init__(self, n_heads, n_kv_heads, head_dim):
        super().__init__()
        self.shape = (n_heads, n_kv_heads, head_dim)

    def forward(self, q, k, v):
        h, kvh, d = self.shape
        t = q.shape[0]
        cu = torch.tensor([0, t], dtype=torch.int32)  # one prompt
        out, _ = REF.attention(q.view(t, h, d), k.view(t, kvh, d), v.reshape(t, kvh, d), cu, t, d ** -0.5)
        return out.reshape(t, h * d)


class FakeSelfAttn(nn.Module):
    def __init__(self, ours, rotary):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = ours.n_heads, ours.n_kv_heads, ours.head_dim
        self.qkv_proj = FakeLinear(ours.qkv_proj.weight)
        self.q_norm = FakeRMSNorm(ours.q_norm.weight, ours.q_norm.eps)
        self.k_norm = FakeRMSNorm(ours.k_norm.weight, ours.k_norm.eps)
        self.rotary_emb = rotary
        self.attn = FakeAttn(self.n_heads, self.n_kv_heads, self.head_dim)
        self.o_proj = FakeLinear(ours.o_proj.weight)

    def forward(self, positions, hidden_states):
        t, d = hidden_states.shape[0], self.head_dim
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(t, self.n_heads, d)).view(t, -1)  # q views the q_norm output
        k = self.k_norm(k.reshape(t, self.n_kv_heads, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class FakeAct(nn.Module):
    def forward(self, x):
        return REF.silu_and_mul(x)


class FakeMLP(nn.Module):
    def __init__(self, ours):
        super().__init__()
        self.gate_up_proj = FakeLinear(ours.gate_up_proj.weight)
        self.act_fn = FakeAct()
        self.down_proj = FakeLinear(ours.down_proj.weight)

    def forward(self, x):
        out, _ = self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))
        return out


class FakeLayer(nn.Module):
    def __init__(self, ours, rotary):
        super().__init__()
        self.input_layernorm = FakeRMSNorm(ours.attention_norm.weight, ours.attention_norm.eps)
        self.self_attn = FakeSelfAttn(ours.attention, rotary)
        self.post_attention_layernorm = FakeRMSNorm(ours.ffn_norm.weight, ours.ffn_norm.eps)
        self.mlp = FakeMLP(ours.feed_forward)

    def forward(self, positions, h, residual):  # vLLM's Qwen2/Qwen3 decoder layer
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions=positions, hidden_states=h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class FakeLogitsProcessor(nn.Module):
    def forward(self, lm_head, h):
        return REF.linear(h, lm_head.weight)


class FakeVLLMQwen3(nn.Module):
    """Qwen3ForCausalLM as vLLM lays it out, sharing our tiny model's weights."""

    def __init__(self, ours: Qwen3VLLMCompatModel):
        super().__init__()
        cache = ours.rope_cache(ours.tok_embeddings.weight)
        rotary = FakeRotary(cache, ours.args.head_dim)
        self.model = nn.Module()
        self.model.embed_tokens = ours.tok_embeddings
        self.model.layers = nn.ModuleList(FakeLayer(layer, rotary) for layer in ours.layers)
        self.model.norm = FakeRMSNorm(ours.norm.weight, ours.norm.eps)
        self.lm_head = FakeLinear(ours.output_weight())
        self.logits_processor = FakeLogitsProcessor()

    @torch.no_grad()
    def forward(self, tokens, positions):
        h, residual = self.model.embed_tokens(tokens), None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.model.norm(h, residual)
        return self.logits_processor(self.lm_head, h[-1:])  # the sampled row only


def test_capture_vllm_matches_capture_ours_on_same_math():
    model = tiny_model()
    p = pack(SEQUENCES[:1])  # vLLM side: one prompt
    fake = FakeVLLMQwen3(model)
    theirs = capture_vllm(fake, lambda: fake(p.tokens, p.positions))

    shapes = expected_shapes(model, p.tokens.numel())
    shapes["logits"] = (1, model.args.vocab_size)
    assert {n: tuple(t.shape) for n, t in theirs.items()} == shapes  # rotary reshaped to [T, H, D]
    assert all_hooks(fake) == 0

    report = localize(capture(model, p), theirs)
    assert report.first_divergence is None, report.format()
    assert len(report.comparisons) == len(shapes) and not report.mismatches
    # The q_norm capture was taken before the shared rotary rotated that tensor in place.
    assert not torch.equal(theirs["layers.0.q_norm"], theirs["layers.0.rotary_q"])


def test_capture_vllm_keeps_the_first_forward_and_warns():
    model = tiny_model()
    p = pack(SEQUENCES[:1])
    fake = FakeVLLMQwen3(model)

    def two_forwards():
        fake(p.tokens, p.positions)
        fake(p.tokens.flip(0), p.positions)

    with pytest.warns(UserWarning, match="more than one forward"):
        theirs = capture_vllm(fake, two_forwards)
    report = localize(capture(model, p), theirs)
    assert report.first_divergence is None, report.format()
