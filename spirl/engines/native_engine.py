"""A plain-PyTorch rollout engine with a KV cache, on the trainer's own Qwen3VLLMCompatModel.

Sampling: one prompt at a time; the prompt is prefilled once and its KV cache copied to the
`n` samples, which then decode together (they all have the same length, so no padding). Tokens
are drawn from softmax(logits / temperature) with a seeded `torch.Generator`: same seed, same
weights -> same samples.

Logprobs: a KV-cache decode does not compute the same float operations as the trainer's packed
full-sequence forward (different matmul shapes and attention splits), so its logprobs are not
bitwise equal to the trainer's in general. The reported logprob of each sampled token (and, for
Qwen3-MoE, each token's experts) is therefore *re-scored* after sampling with `spirl.numerics.parity.sampled_logprobs`, the very packed
forward the trainer uses, under the distribution the logprobs mode names (`sampling`: logits / T
then min-p, as vLLM's processed logprobs; `raw`: the raw logits). The per-step parity check is
then exact by construction for this engine; it exists to test the plumbing on CPU. The real check
is vLLM on the GPU.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from ..numerics.parity import SamplingDist, every_token_logprobs, logprob_dist, sampled_logprobs_and_routes
from ..numerics.samples import Sample
from .base import Request


class NativeEngine:
    samples_beside_training: bool = False
    """The trainer's own model on the CPU, whose GEMMs split their work by the threads free: --off-policy-steps
    samples when the rollout is asked for, never beside the trainer (spirl.loops.ahead)."""

    def __init__(self, model, eos_ids: Iterable[int], logprobs: str = "raw", one_per_forward: bool = False):
        self.model = model
        """The trainer's compute model itself: weight sync is then a no-op (see load_weights)."""
        self.one_per_forward = one_per_forward
        """Rescore each sequence in a forward of its own, over every row. The reference backend (CPU)
        is not batch invariant (a GEMM's bits depend on its row count), so a logprob has the trainer's
        bits only if the trainer computes it the same way: the Tinker API's trainer then scores one
        datum per forward, every position of it."""
        self.eos_ids = set(int(i) for i in eos_ids)
        self.logprobs = logprobs
        """`sampling` or `raw`: which distribution's logprobs the samples carry."""

    def dist(self, temperature: float, min_p: float) -> SamplingDist:
        return logprob_dist(self.logprobs, temperature, min_p)

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 64,
                 temperature: float = 1.0, seed: int | list[int] | None = None,
                 min_p: float = 0.0, top_k: int = -1, top_p: float = 1.0) -> list[Sample]:
        """n samples per prompt, prompt-major (like VLLMEngine.generate). `seed`: one for the
        call, or one per prompt."""
        if isinstance(seed, list):
            if len(seed) != len(prompts):
                raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts")
            gens = [torch.Generator(device=self.device).manual_seed(s) for s in seed]
        else:
            gens = [torch.Generator(device=self.device).manual_seed(0 if seed is None else seed)] * len(prompts)
        pick = dict(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
        samples = []
        for prompt, gen in zip(prompts, gens):
            for completion, reason in self._sample_group(list(prompt), n, max_tokens, pick, gen):
                samples.append(Sample(list(prompt), completion, torch.empty(0), reason))
        return self.rescore(samples, temperature, min_p)

    @torch.no_grad()
    def sample(self, requests: list[Request]) -> list[list[Sample]]:
        """Each request's n samples with its own settings (sampled one request at a time), their logprobs from one
        packed forward over every sample of the call that shares a temperature and min-p: the forward the trainer's
        parity check runs over the same samples (--partial-rollout-tokens sends new prompts and continuations in
        one call; the Tinker API's engine scores each sequence alone, `one_per_forward`)."""
        out, by_dist = [], {}
        for r in requests:
            gen = torch.Generator(device=self.device).manual_seed(0 if r.seed is None else r.seed)
            pick = dict(temperature=r.temperature, min_p=r.min_p, top_k=r.top_k, top_p=r.top_p) if r.temperature > 0 \
                else {"greedy": True}
            stops = set(r.stop_token_ids) | (set() if r.ignore_eos else self.eos_ids)
            group = [Sample(list(r.prompt), c, torch.empty(0), reason)
                     for c, reason in self._sample_group(list(r.prompt), r.n, r.max_tokens, pick, gen, stops)]
            by_dist.setdefault((r.temperature, r.min_p), []).extend(group)
            out.append(group)
        for (temperature, min_p), seqs in by_dist.items():
            self.rescore(seqs, temperature, min_p)  # sets each sample's logprobs (and routes) in place
        return out

    @torch.no_grad()
    def rescore(self, seqs: list, temperature: float = 1.0, min_p: float = 0.0) -> list:
        """Set every sequence's logprobs to the trainer's packed forward over exactly these
        sequences (see the module docstring). Multi-turn rollouts call it on whole trajectories."""
        dist = self.dist(temperature, min_p)
        if not self.one_per_forward:
            lps, routes = sampled_logprobs_and_routes(self.model, seqs, self.device, dist)
            for i, (s, lp) in enumerate(zip(seqs, lps)):
                s.logprobs = lp.float().cpu()
                if routes is not None and hasattr(s, "routes"):  # the same forward's experts (Qwen3-MoE)
                    s.routes = routes[i]
            return seqs
        for s in seqs:  # alone, and every row (as the Tinker trainer scores a datum), then the sampled ones
            every = every_token_logprobs(self.model, [s.ids], self.device, dist, one_per_forward=True)[0]
            s.logprobs = every[torch.tensor(s.loss_mask[1:])].float().cpu()
        return seqs

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Copy (compat name, tensor) pairs in; tensors that already are the model's are skipped."""
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            p = params[name]
            if t.data_ptr() != p.data_ptr():
                p.data.copy_(t)
        return 0.0

    def close(self) -> None:
        """Nothing to release (the model is the trainer's)."""

    # -- decoding ------------------------------------------------------------------------------

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int = 64) -> list[list[int]]:
        """The argmax completion of each prompt (evaluation), ending at the first EOS or max_tokens."""
        gen = torch.Generator(device=self.device)
        return [self._sample_group(list(p), 1, max_tokens, {"greedy": True}, gen)[0][0] for p in prompts]

    def _pick(self, logits: torch.Tensor, pick: dict, gen: torch.Generator) -> torch.Tensor:
        """A draw from softmax(logits / T) after min-p, then top-k and top-p (vLLM's order);
        the argmax when `pick` asks for greedy decoding."""
        if pick.get("greedy"):
            return logits.argmax(dim=-1)
        z = self.model.backend.sampling_logits(logits, pick["temperature"], pick["min_p"]).float()
        if pick["top_k"] > 0:
            kth = z.topk(min(pick["top_k"], z.shape[-1]), dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if pick["top_p"] < 1.0:
            sorted_z, order = z.sort(dim=-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop = cum - sorted_z.softmax(-1) >= pick["top_p"]  # keep the smallest prefix reaching top_p
            z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
        return torch.multinomial(torch.softmax(z, dim=-1), 1, generator=gen).squeeze(-1)

    def _sample_group(self, prompt, n, max_tokens, pick, gen, stops=None):
        stops = self.eos_ids if stops is None else stops
        dev = self.device
        tokens = torch.tensor(prompt, device=dev)
        positions = torch.arange(len(prompt), device=dev)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = self._step(tokens, positions, cache, prefill=True)[-1:].expand(n, -1)
        cache[:] = [(k.expand(n, -1, -1, -1).contiguous(), v.expand(n, -1, -1, -1).contiguous()) for k, v in cache]
        out = [[] for _ in range(n)]
        done = [None] * n
        for t in range(max_tokens):
            nxt = self._pick(logits, pick, gen)
            for i, tok in enumerate(nxt.tolist()):
                if done[i] is None:
                    out[i].append(tok)
                    if tok in stops:
                        done[i] = "stop"
            if all(d is not None for d in done) or t == max_tokens - 1:
                break
            pos = torch.full((n,), len(prompt) + t, device=dev)
            logits = self._step(nxt, pos, cache, prefill=False)
        return [(o, d or "length") for o, d in zip(out, done)]

    def _step(self, tokens, positions, cache, prefill: bool) -> torch.Tensor:
        """Prefill (one sequence, T tokens) or decode (n sequences, 1 token each); logits [T or n, V]."""
        m = self.model
        be, a = m.backend, m.args
        h = m.tok_embeddings(tokens)
        rope = m.rope_cache(h)
        for i, layer in enumerate(m.layers):
            attn = layer.attention
            x = be.rms_norm(h, layer.attention_norm.weight, layer.attention_norm.eps)
            q, k, v = be.linear(x, attn.qkv_proj.weight).split(
                [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
            q = be.rms_norm(q.reshape(-1, a.n_heads, a.head_dim), attn.q_norm.weight, attn.q_norm.eps)
            k = be.rms_norm(k.reshape(-1, a.n_kv_heads, a.head_dim), attn.k_norm.weight, attn.k_norm.eps)
            q, k = be.rotary(positions, q, k, rope)
            v = v.reshape(-1, a.n_kv_heads, a.head_dim)
            o = self._attend(i, q, k, v, cache, prefill)
            h = h + be.linear(o, attn.o_proj.weight)
            x = be.rms_norm(h, layer.ffn_norm.weight, layer.ffn_norm.eps)
            h = h + self._mlp(layer, x)
        h = be.rms_norm(h, m.norm.weight, m.norm.eps)
        return be.linear(h, m.output_weight())

    def _mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP, or a Qwen3-MoE sparse layer's router, top-k and experts (the backend's own ops)."""
        be = self.model.backend
        if hasattr(layer, "moe"):
            moe = layer.moe
            w, ids = be.moe_route(be.linear(x, moe.router.weight), moe.top_k, moe.renormalize)
            return be.moe_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, w, ids)[0]
        ff = layer.feed_forward
        return be.linear(be.silu_and_mul(be.linear(x, ff.gate_up_proj.weight)), ff.down_proj.weight)

    def _attend(self, i, q, k, v, cache, prefill: bool) -> torch.Tensor:
        a = self.model.args
        rep = a.n_heads // a.n_kv_heads
        if prefill:  # q, k, v [T, H, D] of one sequence -> cache [1, Hk, T, D]
            cache.append((k.transpose(0, 1)[None], v.transpose(0, 1)[None]))
            kk, vv = cache[i]
            qq = q.transpose(0, 1)[None]
            causal = True
        else:  # one new token per sequence: q, k, v [n, H, D]; append to the cache
            ck, cv = cache[i]
            kk, vv = torch.cat([ck, k[:, :, None]], dim=2), torch.cat([cv, v[:, :, None]], dim=2)
            cache[i] = (kk, vv)
            qq = q[:, :, None]
            causal = False  # the new token attends to every cached position
        o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                           is_causal=causal, scale=a.head_dim ** -0.5)
        return o.transpose(1, 2).reshape(-1, a.n_heads * a.head_dim)  # [T or n, H*D]
