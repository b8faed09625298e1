"""Each op of the `vllm` kernel backend against the vLLM layer module (or kernel call) it mirrors.

Inputs are random bf16 activations; the modules are the live engine's own (tiny checkpoint), so
the test also proves that our merged weights equal what vLLM loaded. Every check is torch.equal:
an upstream kernel change shows up here as one failing op.
"""

from __future__ import annotations

import pytest
import torch

T = 300  # > 256: the row count at which vLLM's fused add+norm changes its block size


def rand(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.fixture(scope="module")
def pair(tiny_harness):
    return tiny_harness.engine.model, tiny_harness.model


def test_weights_equal_what_vllm_loaded(pair):
    vm, ours = pair
    vl, ol = vm.model.layers[1], ours.layers[1]
    assert torch.equal(vl.self_attn.qkv_proj.weight, ol.attention.qkv_proj.weight)
    assert torch.equal(vl.mlp.gate_up_proj.weight, ol.feed_forward.gate_up_proj.weight)
    assert torch.equal(vl.mlp.down_proj.weight, ol.feed_forward.down_proj.weight)
    assert torch.equal(vm.lm_head.weight, ours.output_weight())


def test_embedding(pair):
    vm, ours = pair
    ids = torch.randint(0, 151643, (T,), device="cuda")
    assert torch.equal(vm.model.embed_tokens(ids), ours.tok_embeddings(ids))


@pytest.mark.parametrize("proj", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
def test_linear(pair, proj):
    vm, ours = pair
    vl, ol = vm.model.layers[0], ours.layers[0]
    mod, w = {"qkv_proj": (vl.self_attn.qkv_proj, ol.attention.qkv_proj.weight),
              "o_proj": (vl.self_attn.o_proj, ol.attention.o_proj.weight),
              "gate_up_proj": (vl.mlp.gate_up_proj, ol.feed_forward.gate_up_proj.weight),
              "down_proj": (vl.mlp.down_proj, ol.feed_forward.down_proj.weight)}[proj]
    x = rand(T, mod.weight.shape[1])
    assert torch.equal(mod(x)[0], ours.backend.linear(x, w))


def test_lm_head_logits(pair):
    vm, ours = pair
    h = rand(T, ours.args.dim)
    assert torch.equal(vm.logits_processor(vm.lm_head, h), ours.backend.linear(h, ours.output_weight()))


def test_rms_norm_without_residual(pair):
    vm, ours = pair
    norm = vm.model.layers[0].input_layernorm
    x = rand(T, ours.args.dim, scale=3)
    assert torch.equal(norm(x.clone()), ours.backend.rms_norm(x, norm.weight, norm.variance_epsilon))


def test_rms_norm_with_residual_is_patched_to_add_then_norm(pair):
    """vLLM's residual path (patched by spirl.numerics.vllm_patches) == bf16 add, then our rms_norm."""
    vm, ours = pair
    norm = vm.model.layers[1].input_layernorm
    x, res = rand(T, ours.args.dim, seed=1), rand(T, ours.args.dim, seed=2)
    v_out, v_res = norm(x.clone(), res.clone())
    new_res = res + x
    assert torch.equal(v_res, new_res)
    assert torch.equal(v_out, ours.backend.rms_norm(new_res, norm.weight, norm.variance_epsilon))


@pytest.mark.parametrize("n", [1024, 2048, 2560, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_add_rms_norm_equals_add_then_vllms_norm(n, rows):
    """spirl_kernels.add_rms_norm (what the patched engine runs) == torch's bf16 add_, then vLLM's Triton
    rms_norm_batch_invariant: the new residual and the output, bit for bit."""
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    from spirl_kernels.add_rms_norm import add_rms_norm_

    x, res, w = rand(rows, n, scale=3, seed=n + rows), rand(rows, n, seed=2), rand(n, seed=3)
    ref_res = res.clone()
    ref_res.add_(x)
    ref_out = rms_norm_batch_invariant(ref_res, w, 1e-6)
    fused_res = res.clone()
    out = add_rms_norm_(x, fused_res, w, 1e-6)
    assert torch.equal(fused_res, ref_res)
    assert torch.equal(out, ref_out)


def test_qk_norm_per_head(pair):
    vm, ours = pair
    attn = vm.model.layers[0].self_attn
    q = rand(T, ours.args.n_heads, ours.args.head_dim, scale=2)
    assert torch.equal(attn.q_norm(q.clone()), ours.backend.rms_norm(q, attn.q_norm.weight, 1e-6))


def test_silu_and_mul(pair):
    vm, ours = pair
    x = rand(T, 2 * ours.args.hidden_dim, scale=2)
    assert torch.equal(vm.model.layers[0].mlp.act_fn(x), ours.backend.silu_and_mul(x))


def test_rotary_cache_and_kernel(pair):
    vm, ours = pair
    rope = vm.model.layers[0].self_attn.rotary_emb
    cache = ours.rope_cache(rand(1, 1))
    assert torch.equal(rope.cos_sin_cache, cache), "trainer's rotary table differs from vLLM's"
    a = ours.args
    pos = torch.randint(0, 4096, (T,), device="cuda")
    q, k = rand(T, a.n_heads, a.head_dim, seed=3), rand(T, a.n_kv_heads, a.head_dim, seed=4)
    vq, vk = rope(pos, q.reshape(T, -1).clone(), k.reshape(T, -1).clone())
    oq, ok = ours.backend.rotary(pos, q.clone(), k.clone(), cache)
    assert torch.equal(vq, oq.reshape(T, -1)) and torch.equal(vk, ok.reshape(T, -1))


def test_qk_norm_rope_equals_vllms_attention_path(pair):
    """Our one-pass q/k step == vLLM's Qwen3Attention: qkv split, q_norm/k_norm modules per head,
    then its rotary module, on strided slices of one qkv output (as the model passes them)."""
    vm, ours = pair
    attn, a = vm.model.layers[0].self_attn, ours.args
    d, hq, hk = a.head_dim, a.n_heads, a.n_kv_heads
    pos = torch.randint(0, 40960, (T,), device="cuda")
    for scale, seed in ((1.0, 8), (0.02, 9), (40.0, 10)):
        qkv = rand(T, (hq + 2 * hk) * d, scale=scale, seed=seed)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        vq = attn.q_norm(q.reshape(T, hq, d).clone()).reshape(T, hq * d)
        vk = attn.k_norm(k.reshape(T, hk, d).clone()).reshape(T, hk * d)
        vq, vk = attn.rotary_emb(pos, vq, vk)
        oq, ok = ours.backend.qk_norm_rope(pos, q.view(T, hq, d), k.view(T, hk, d), attn.q_norm.weight,
                                           attn.k_norm.weight, attn.q_norm.variance_epsilon, ours.rope_cache(qkv))
        assert torch.equal(oq.reshape(T, -1), vq) and torch.equal(ok.reshape(T, -1), vk)


def test_engines_qwen3_attention_runs_the_fused_qk_with_vllms_bits(pair):
    """vllm_patches patch 3: the engine's own Qwen3Attention layers pass fused_qk's gate (so the patched
    forward runs spirl_kernels.qk_norm_rope), and its q and k equal those of the layer's vLLM modules -
    q_norm/k_norm on the per-head views of the qkv slices, then rotary_emb in place - bit for bit."""
    from vllm.model_executor.models.qwen3 import Qwen3Attention

    from spirl.numerics import vllm_patches

    vm, _ = pair
    assert hasattr(Qwen3Attention.forward, "__wrapped__")  # the patch is installed
    for layer in (vm.model.layers[0], vm.model.layers[-1]):
        attn = layer.self_attn
        d = attn.head_dim
        pos = torch.randint(0, 40960, (T,), device="cuda")
        for scale, seed in ((1.0, 21), (0.02, 22), (40.0, 23)):
            qkv = rand(T, attn.q_size + 2 * attn.kv_size, scale=scale, seed=seed)
            q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            fused = vllm_patches.fused_qk(attn, pos, q, k)
            assert fused is not None, "the engine's layer declined the fused q/k path"
            vq = attn.q_norm(q.view(T, -1, d)).view(T, -1)
            vk = attn.k_norm(k.view(T, -1, d)).view(T, -1)
            vq, vk = attn.rotary_emb(pos, vq, vk)
            assert torch.equal(fused[0], vq) and torch.equal(fused[1], vk)


@pytest.mark.parametrize("rows", [None, 1, "vllm_block", 16, 64])
@pytest.mark.parametrize("hq,hk,d", [(16, 8, 128), (32, 8, 128), (40, 8, 128), (14, 2, 64), (8, 8, 256)])
def test_fused_qk_norm_rope_kernel_equals_vllms_two_kernels(hq, hk, d, rows):
    """spirl_kernels.qk_norm_rope against rms_norm_batch_invariant then torch.ops._C.rotary_embedding,
    over head counts and sizes, 3001 tokens (~100k rows, most counts leave a partial last block), random
    norm weights, long positions; one row per program, blocks of 1024 elements (vLLM's norm width) up
    to 64 rows, and the default choice; q alone, and q and k in one launch."""
    import vllm._custom_ops  # noqa: F401
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    from spirl_kernels.qk_norm_rope import VLLM_NORM_BLOCK, fusable, norm_rope, norm_rope_qk
    from torchtitan_compat.vllm_ops import VLLMBackend

    rows = VLLM_NORM_BLOCK // d if rows == "vllm_block" else rows
    t, eps = 3001, 1e-6
    cache = VLLMBackend(require_batch_invariant=False).rope_cache(d, 40960, 1e6, torch.bfloat16, "cuda")
    pos = torch.randint(0, 40960, (t,), device="cuda")
    qkv = rand(t, (hq + 2 * hk) * d, scale=3, seed=11)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    wq, wk = 1 + rand(d, scale=0.3, seed=12), 1 + rand(d, scale=0.3, seed=13)
    assert fusable(q, wq, cache) and fusable(k, wk, cache)
    vq, vk = rms_norm_batch_invariant(q, wq, eps), rms_norm_batch_invariant(k, wk, eps)
    torch.ops._C.rotary_embedding(pos, vq.view(t, -1), vk.view(t, -1), d, cache, True)
    assert torch.equal(norm_rope(q, wq, eps, pos, cache, rows), vq)
    oq, ok = norm_rope_qk(q, k, wq, wk, eps, pos, cache, rows)
    assert torch.equal(oq, vq) and torch.equal(ok, vk)
    few = slice(0, 3)  # a decode-sized call: the default runs one row per program
    oq, ok = norm_rope_qk(q[few], k[few], wq, wk, eps, pos[few], cache, rows)
    assert torch.equal(oq, vq[few]) and torch.equal(ok, vk[few])


def test_attention_equals_vllm_paged_prefill_and_decode(pair):
    """Contiguous varlen FA3 (trainer) == vLLM's paged-KV calls, for prefill and for decode."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    _, ours = pair
    a, block = ours.args, 16
    lens = [1, 17, 300, 64]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    n = int(cu[-1])
    q, k, v = (rand(n, h, a.head_dim, seed=s) for h, s in
               ((a.n_heads, 5), (a.n_kv_heads, 6), (a.n_kv_heads, 7)))
    out, lse = ours.backend.attention(q, k, v, cu, max(lens), a.head_dim ** -0.5)
    assert lse.shape == (a.n_heads, n)
    kv = torch.cat([k, v], dim=-1)  # v as the model passes it: a strided slice of a wider tensor
    strided = ours.backend.attention(q, k, kv[..., a.head_dim:], cu, max(lens), a.head_dim ** -0.5)[0]
    assert torch.equal(strided, out)
    # vLLM's layout: a paged cache, each sequence in its own run of blocks.
    blocks_per_seq = [(m + block - 1) // block for m in lens]
    kc = torch.zeros(sum(blocks_per_seq) + 1, block, a.n_kv_heads, a.head_dim, dtype=q.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    nxt = 1
    for i, m in enumerate(lens):  # each sequence gets its own run of blocks, filled block by block
        table[i, :blocks_per_seq[i]] = torch.arange(nxt, nxt + blocks_per_seq[i], device="cuda")
        nxt += blocks_per_seq[i]
        s = int(cu[i])
        for b in range(blocks_per_seq[i]):
            rows = slice(s + b * block, s + min((b + 1) * block, m))
            kc[table[i, b], :rows.stop - rows.start] = k[rows]
            vc[table[i, b], :rows.stop - rows.start] = v[rows]
    seqused = torch.tensor(lens, dtype=torch.int32, device="cuda")
    common = dict(softmax_scale=a.head_dim ** -0.5, causal=True, num_splits=1, fa_version=3)
    prefill = flash_attn_varlen_func(q, kc, vc, max_seqlen_q=max(lens), cu_seqlens_q=cu,
                                     max_seqlen_k=max(lens), seqused_k=seqused, block_table=table, **common)
    assert torch.equal(prefill, out)
    last = cu[1:] - 1  # decode: the last token of each sequence, one query row each
    cu_dec = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    decode = flash_attn_varlen_func(q[last.long()], kc, vc, max_seqlen_q=1, cu_seqlens_q=cu_dec,
                                    max_seqlen_k=max(lens), seqused_k=seqused, block_table=table, **common)
    assert torch.equal(decode, out[last.long()])


def test_token_logprobs_is_the_samplers_kernel_not_log_softmax(pair):
    """The trainer's logprob is vLLM's sampler kernel; torch.log_softmax differs in some rows."""
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    _, ours = pair
    logits = rand(256, 151936, scale=4)
    ids = torch.randint(0, 151936, (256,), device="cuda")
    got = ours.backend.token_logprobs(logits, ids)
    assert torch.equal(got, compute_token_logprobs(logits, ids[:, None])[:, 0])
    torch_lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
    print(f"rows where torch.log_softmax differs from vLLM's kernel: {int((torch_lp != got).sum())}/256")
