"""FlashAttention-3's KV split under batch invariance: bitwise checks, and what a split costs.

    VLLM_BATCH_INVARIANT=1 python compare/fa3_split.py --check            # bitwise, seconds
    VLLM_BATCH_INVARIANT=1 python compare/fa3_split.py --cost [--json F]  # decode and trainer-side timings

Why (issue 39): vLLM 0.26's batch-invariant mode runs FA3 with num_splits=1, so a decode step of 1-4 long
sequences runs one CTA per sequence and KV head (8 on 132 SMs at Qwen3-8B, batch 1), while plain vLLM
splits the KV range. FA3 gives a row the KV blocks [i*ceil(nb/S), (i+1)*ceil(nb/S)) in split i, nb being
the row's own block count when the query tile does not cross a 128-key block (hopper/block.h), but it
recomputes each sequence's split count S on the GPU from the whole batch's work
(flash_prepare_scheduler.cu): not batch invariant. Passing FA3's own scheduler metadata with the
per-sequence split counts overwritten fixes S per sequence, whatever the batch.
SPIRL does not use the split (docs/rollout-profile.md, session 53): one that costs prefill nothing covers decode
rows only, and vLLM also prefills generated rows (a preempted request, earlier turns), so a row's bits would
depend on how it was computed. This tool keeps the measurement and the FA3 behaviour it relies on reproducible.

--check (torch.equal on out and lse; head configs 16/8, 32/8, 40/8 = Qwen3-0.6B/1.7B, 8B, 14B; S 1-16):
  fixed      decode rows (paged KV, one query each; alone, all together, among 60 other sequences) ==
             the trainer's rows (one varlen causal prefill, not paged), every sequence's S fixed
  dynamic    the same with FA3's own split counts (plain vLLM's): expected to DIFFER (the check can fail)
  chunks     vLLM-style prefill chunks (paged) starting at multiples of 128 == trainer rows; chunks
             starting elsewhere are expected to DIFFER for S > 1 (a tile then spans two KV blocks)
  entries    split count 1 inside the split kernel == the num_splits=1 kernel; the call's static split
             count leaves a row's bits alone; the trainer's completion rows cut into 128-aligned paged
             entries with S_i = --per/--cap rule of each entry's block count == decode rows with that rule;
             the rule's split rows (S > 1) are expected to DIFFER from the same rows computed unsplit, as
             vLLM recomputes a preempted request's or an earlier turn's generated rows (why SPIRL does not split)
  Exit status 0 only if every expected-equal check holds and every expected difference shows.
--cost: FA3 decode time per call (CUDA graph replays) for batch x context x S next to plain vLLM's
  (num_splits 32 with FA3's dynamic metadata, as vLLM builds it for CUDA graphs), and the trainer side:
  one varlen prefill at S vs 1 (time, extra memory), and completion rows as aligned entries under the rule.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEAD_DIM = 128
PAGE = 16  # vLLM's KV block size for FA3
KV_BLOCK = 128  # FA3's kBlockN at head dim 128 (causal, and paged without TMA): the split unit
MAX_SPLIT_BATCH = 992  # FA3 turns splits off above this many sequences (flash_api.cpp, PREPARE_VARLEN_MAX_BATCHES_1CTA)
HEADS = {"Qwen3-0.6B/1.7B": (16, 8), "Qwen3-8B": (32, 8), "Qwen3-14B": (40, 8)}


def split_slot(batch: int) -> slice:
    """Where FA3's scheduler metadata keeps each sequence's split count: after `prepare_seqlen_q`, both
    padded to a multiple of 4 sequences (flash_api.cpp, mha_fwd_get_scheduler_metadata: 'ORDER:
    {prepare_seqlen_q, num_splits_dynamic, ...}'). Present only for batch <= 992 and num_splits > 1."""
    if not 1 <= batch <= MAX_SPLIT_BATCH:
        raise ValueError(f"{batch} sequences in one call: FA3 splits the KV range only for 1-{MAX_SPLIT_BATCH}")
    padded = (batch + 3) // 4 * 4
    return slice(padded, padded + batch)


def length_rule(blocks, per: int, cap: int):
    """Split count of a row from its own KV block count alone (so from nothing the batch holds): one split per
    `per` blocks, at least 1, at most `cap`. Works on ints and integer tensors."""
    if per < 1 or cap < 1:
        raise ValueError(f"per and cap must be >= 1 (got per={per}, cap={cap})")
    if isinstance(blocks, int):
        return max(1, min(cap, blocks // per))
    return (blocks // per).clamp(1, cap).to(blocks.dtype)


def aligned_entries(prompt_lens, seq_lens, block: int = KV_BLOCK):
    """The completion rows [P, L) of each sequence cut where a KV block starts: (sequence, start, end) per
    entry. Each entry's rows share one KV block count, so a split rule of that count gives each row the
    split a decode step of that row gets."""
    out = []
    for s, (p, n) in enumerate(zip(prompt_lens, seq_lens)):
        if not 0 <= p <= n:
            raise ValueError(f"sequence {s}: prompt length {p} is not within its length {n}")
        a = p
        while a < n:
            e = min(n, (a // block + 1) * block)
            out.append((s, a, e))
            a = e
    return out


def entry_batch(torch, q, seq_starts, ents, dev):
    """Aligned entries (`aligned_entries`) as one paged varlen call's inputs: their query rows, cu_seqlens_q,
    seqused_k (each entry sees its sequence's keys up to its end), and each entry's first row in the rows."""
    rows = torch.cat([q[seq_starts[s] + a:seq_starts[s] + e] for s, a, e in ents])
    cut = [0]
    for _, a, e in ents:
        cut.append(cut[-1] + e - a)
    used = torch.tensor([e for _, _, e in ents], dtype=torch.int32, device=dev)
    return rows, torch.tensor(cut, dtype=torch.int32, device=dev), used, cut


class FA3:
    """vLLM's FA3 entry points, called as vLLM and this project's trainer call them."""

    def __init__(self):
        import torch
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        self.torch, self.attn, self.get_md = torch, flash_attn_varlen_func, get_scheduler_metadata
        self.dev = torch.device("cuda")

    def metadata(self, static, splits, max_q, max_k, hq, hk, used, cu_q, page_size):
        """FA3's own metadata for the call, every sequence's split count then set to `splits` (an int or a
        per-sequence tensor); None (FA3 computes its own) when `splits` is None."""
        md = self.get_md(used.numel(), max_q, max_k, hq, hk, HEAD_DIM, used, qkv_dtype=self.torch.bfloat16,
                         cu_seqlens_q=cu_q, page_size=page_size, causal=True, num_splits=static)
        if splits is not None and static > 1:
            md[split_slot(used.numel())] = splits
        return md

    def varlen(self, q, k, v, cu, lens, max_len, static, splits, hq, hk):
        """The trainer's call (torchtitan_compat/vllm_ops.py: varlen, causal, not paged), optionally split."""
        kw = {}
        if static > 1:
            kw["scheduler_metadata"] = self.metadata(static, splits, max_len, max_len, hq, hk, lens, cu, None)
        return self.attn(q, k, v, max_seqlen_q=max_len, cu_seqlens_q=cu, max_seqlen_k=max_len, cu_seqlens_k=cu,
                         softmax_scale=HEAD_DIM ** -0.5, causal=True, num_splits=static, fa_version=3,
                         return_softmax_lse=True, **kw)

    def paged(self, q, kc, vc, table, used, cu_q, max_q, max_k, static, splits, hq, hk, md=None):
        """vLLM's call (paged KV, seqused_k); `md` reuses metadata built before a CUDA graph capture."""
        if md is None and static > 1:
            md = self.metadata(static, splits, max_q, max_k, hq, hk, used, cu_q, PAGE)
        return self.attn(q, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k, seqused_k=used,
                         block_table=table, softmax_scale=HEAD_DIM ** -0.5, causal=True, num_splits=static,
                         fa_version=3, return_softmax_lse=True,
                         **({"scheduler_metadata": md} if md is not None else {}))


class PagedCache:
    """Whole sequences' K and V in a paged cache (vLLM's layout [pages, PAGE, kv heads, dim]), pages shuffled."""

    def __init__(self, torch, ks, vs, hk, dev):
        n_pages = [(k.shape[0] + PAGE - 1) // PAGE for k in ks]
        perm = torch.randperm(sum(n_pages), device=dev)
        self.kc = torch.randn(sum(n_pages), PAGE, hk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.vc = torch.randn_like(self.kc)
        self.pages, o = [], 0
        for k, v, n in zip(ks, vs, n_pages):
            p = perm[o:o + n]
            o += n
            for src, dst in ((k, self.kc), (v, self.vc)):
                buf = torch.zeros(n * PAGE, hk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                buf[:src.shape[0]] = src
                dst[p] = buf.view(n, PAGE, hk, HEAD_DIM)
            self.pages.append(p)
        self.torch, self.dev = torch, dev

    def table(self, seqs, width):
        t = self.torch.zeros(len(seqs), width, dtype=self.torch.int32, device=self.dev)
        for i, s in enumerate(seqs):
            t[i, :self.pages[s].numel()] = self.pages[s][:width]
        return t


def _same(a, b):
    return all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b))


def check(fa: FA3, hq: int, hk: int, S: int, per: int, cap: int) -> dict:
    """One head config and split count; every entry: name -> (holds, expected)."""
    torch, dev = fa.torch, fa.dev
    g = torch.Generator(device=dev).manual_seed(1000 * hq + S)
    lens = [77, 1000, 2100, 4500, 8300]
    others = torch.randint(1, 3000, (60,), generator=torch.Generator().manual_seed(S)).tolist()
    start = [0]
    for n in lens:
        start.append(start[-1] + n)
    T = start[-1]
    q, k, v = (torch.randn(T, h, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
    cu = torch.tensor(start, dtype=torch.int32, device=dev)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref_o, ref_l = fa.varlen(q, k, v, cu, lens_t, max(lens), S, S, hq, hk)
    ks = [k[start[i]:start[i + 1]] for i in range(len(lens))]
    vs = [v[start[i]:start[i + 1]] for i in range(len(lens))]
    ks += [torch.randn(n, hk, HEAD_DIM, device=dev, dtype=torch.bfloat16) for n in others]
    vs += [torch.randn(n, hk, HEAD_DIM, device=dev, dtype=torch.bfloat16) for n in others]
    cache = PagedCache(torch, ks, vs, hk, dev)
    width = (max(lens + others) + PAGE - 1) // PAGE
    picks = [(s, p) for s, n in enumerate(lens)
             for p in sorted({0, 1, 126, 127, 128, 129, 255, 256, n // 3, n // 2, n - 2, n - 1}) if p < n]
    rows = torch.tensor([start[s] + p for s, p in picks], device=dev)
    q_rows, want = q[rows], (ref_o[rows], ref_l[:, rows])

    def decode(entries, qx, splits):
        used = torch.tensor([e[1] for e in entries], dtype=torch.int32, device=dev)
        cu_q = torch.arange(len(entries) + 1, dtype=torch.int32, device=dev)
        return fa.paged(qx, cache.kc, cache.vc, cache.table([e[0] for e in entries], width), used, cu_q, 1,
                        int(used.max()), S, splits, hq, hk)

    res = {}
    mine = [(s, p + 1) for s, p in picks]
    fixed = S if S > 1 else None
    res["fixed: decode rows together == trainer rows"] = (_same(decode(mine, q_rows, fixed), want), True)
    res["fixed: each decode row alone == trainer row"] = (all(
        _same(decode([e], q_rows[i:i + 1], fixed), (want[0][i:i + 1], want[1][:, i:i + 1]))
        for i, e in enumerate(mine)), True)
    filler = [(len(lens) + j, n) for j, n in enumerate(others)]
    q_other = torch.randn(len(filler), hq, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    mixed, qx = filler[:30] + mine + filler[30:], torch.cat([q_other[:30], q_rows, q_other[30:]])
    sel = slice(30, 30 + len(mine))
    o, l = decode(mixed, qx, fixed)
    res["fixed: decode rows among 60 others == trainer rows"] = (_same((o[sel], l[:, sel]), want), True)
    if S > 1:
        o, l = decode(mixed, qx, None)
        res["dynamic (plain vLLM's split counts): among 60 others == trainer rows"] = (
            _same((o[sel], l[:, sel]), want), False)
    s = len(lens) - 1
    for a, e in [(0, 8300), (0, 3000), (2560, 8300), (2560, 6000), (1000, 5000), (2064, 8300), (4000, 4001)]:
        used = torch.tensor([e], dtype=torch.int32, device=dev)
        cu_q = torch.tensor([0, e - a], dtype=torch.int32, device=dev)
        got = fa.paged(q[start[s] + a:start[s] + e], cache.kc, cache.vc, cache.table([s], width), used, cu_q, e - a,
                       e, S, fixed, hq, hk)
        aligned = a % KV_BLOCK == 0 or e - a == 1
        res[f"chunk [{a}, {e}) == trainer rows"] = (
            _same(got, (ref_o[start[s] + a:start[s] + e], ref_l[:, start[s] + a:start[s] + e])), aligned or S == 1)
    if S > 1:
        res.update(entries(fa, hq, hk, S, per, cap, q, k, v, start, lens, cache, width))
    return res


def entries(fa, hq, hk, static, per, cap, q, k, v, start, lens, cache, width) -> dict:
    """The pieces a decode-only, length-ruled split needs (see the module docstring)."""
    torch, dev = fa.torch, fa.dev
    res = {}
    cu = torch.tensor(start, dtype=torch.int32, device=dev)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    plain = fa.varlen(q, k, v, cu, lens_t, max(lens), 1, None, hq, hk)
    got = fa.paged(q, cache.kc, cache.vc, cache.table(range(len(lens)), width), lens_t, cu, max(lens), max(lens),
                   static, 1, hq, hk)
    res[f"entries: split count 1 in the split kernel (static {static}) == num_splits=1 kernel"] = (
        _same(got, plain), True)
    prompts = [min(n, p) for n, p in zip(lens, [10, 100, 512, 2049, 3000])]
    picks = [(s, p) for s, n in enumerate(lens) for p in sorted({prompts[s], prompts[s] + 1, 1023, 1024, 2047,
                                                                    2048, 4095, 4096, n - 1}) if prompts[s] <= p < n]
    pick_rows = torch.tensor([start[s] + p for s, p in picks], device=dev)
    q_rows = q[pick_rows]
    used = torch.tensor([p + 1 for _, p in picks], dtype=torch.int32, device=dev)
    rule = length_rule((used + KV_BLOCK - 1) // KV_BLOCK, per, min(cap, static))
    cu1 = torch.arange(len(picks) + 1, dtype=torch.int32, device=dev)
    table = cache.table([s for s, _ in picks], width)
    dec = fa.paged(q_rows, cache.kc, cache.vc, table, used, cu1, 1, int(used.max()), static, rule, hq, hk)
    dec16 = fa.paged(q_rows, cache.kc, cache.vc, table, used, cu1, 1, int(used.max()), 16, rule, hq, hk)
    res[f"entries: static split count {static} vs 16, same per-row rule: same bits"] = (_same(dec, dec16), True)
    alone = all(_same(fa.paged(q_rows[i:i + 1], cache.kc, cache.vc, table[i:i + 1], used[i:i + 1], cu1[:2], 1,
                               int(used[i]), static, rule[i:i + 1], hq, hk), (dec[0][i:i + 1], dec[1][:, i:i + 1]))
                for i in range(len(picks)))
    res["entries: each ruled decode row alone == batched"] = (alone, True)
    split = (rule > 1).nonzero().flatten()
    rows = pick_rows[split]
    res["entries: ruled decode rows split (S > 1) == the same rows prefilled unsplit (a recomputation)"] = (
        _same((dec[0][split], dec[1][:, split]), (plain[0][rows], plain[1][:, rows])), False)
    ents = aligned_entries(prompts, lens)
    qt, cu_t, used_t, cut = entry_batch(torch, q, start, ents, dev)
    rule_t = length_rule((used_t + KV_BLOCK - 1) // KV_BLOCK, per, min(cap, static))
    ot, lt = fa.paged(qt, cache.kc, cache.vc, cache.table([s for s, _, _ in ents], width), used_t,
                      cu_t, KV_BLOCK, max(lens), static, rule_t, hq, hk)
    at = {}
    for j, (s, a, e) in enumerate(ents):
        for p in range(a, e):
            at[(s, p)] = cut[j] + p - a
    idx = torch.tensor([at[x] for x in picks], device=dev)
    res["entries: trainer completion rows as aligned entries == ruled decode rows"] = (
        _same((ot[idx], lt[:, idx]), dec), True)
    return res


def graph_us(torch, fn, iters: int) -> float:
    """GPU time per call of `fn` replayed from a CUDA graph (no launch cost in it), microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager_us(torch, graph.replay, iters)


def eager_us(torch, fn, iters: int) -> float:
    """GPU time per call of `fn` launched eagerly (for calls that build FA3 metadata, which vLLM never puts in
    a CUDA graph; long prefills, whose launch cost is small beside them), microseconds."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def decode_cost(fa, hq, hk, batches, contexts, splits, per, cap, emit):
    torch, dev = fa.torch, fa.dev
    for L in contexts:
        for b in batches:
            n_pages = (L + PAGE - 1) // PAGE
            kc = torch.randn(b * n_pages, PAGE, hk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = torch.randperm(b * n_pages, device=dev, dtype=torch.int32).view(b, n_pages).contiguous()
            used = torch.full((b,), L, dtype=torch.int32, device=dev)
            cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
            q = torch.randn(b, hq, HEAD_DIM, device=dev, dtype=torch.bfloat16)
            row = {}
            for S in splits:
                md = fa.metadata(S, S, 1, L, hq, hk, used, cu_q, PAGE) if S > 1 else None
                row[f"S{S}_us"] = graph_us(torch, lambda: fa.paged(q, kc, vc, table, used, cu_q, 1, L, S, S, hq, hk,
                                                                   md=md), 50)
            md = fa.metadata(32, None, 1, L, hq, hk, used, cu_q, PAGE)
            row["plain_us"] = graph_us(torch, lambda: fa.paged(q, kc, vc, table, used, cu_q, 1, L, 32, None, hq, hk,
                                                               md=md), 50)
            plain_splits = sorted(set(md[split_slot(b)].tolist()))
            ruled = length_rule((L + KV_BLOCK - 1) // KV_BLOCK, per, cap)
            emit(kind="decode", hq=hq, hk=hk, batch=b, context=L, plain_splits=plain_splits, rule_splits=ruled,
                 **{key: round(val, 2) for key, val in row.items()})


def trainer_cost(fa, hq, hk, shapes, splits, per, cap, emit):
    """One varlen prefill with every sequence at S (time, extra memory over S=1's), and completion rows as
    aligned entries under the length rule next to today's one num_splits=1 call over all rows."""
    torch, dev = fa.torch, fa.dev
    for nseq, L, P in shapes:
        T = nseq * L
        q, k, v = (torch.randn(T, h, HEAD_DIM, device=dev, dtype=torch.bfloat16) for h in (hq, hk, hk))
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
        lens = torch.full((nseq,), L, dtype=torch.int32, device=dev)
        row = {}
        for S in splits:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fa.varlen(q, k, v, cu, lens, L, S, S, hq, hk)
            torch.cuda.synchronize()
            row[f"prefill_S{S}_extra_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)
            us = eager_us(torch, lambda: fa.varlen(q, k, v, cu, lens, L, S, S, hq, hk), 10)
            row[f"prefill_S{S}_us"] = round(us, 1)
        cache = PagedCache(torch, [k[i * L:(i + 1) * L] for i in range(nseq)],
                           [v[i * L:(i + 1) * L] for i in range(nseq)], hk, dev)
        ents = aligned_entries([P] * nseq, [L] * nseq)
        qt, cu_t, used_t, _ = entry_batch(torch, q, range(0, T, L), ents, dev)
        table = cache.table([s for s, _, _ in ents], (L + PAGE - 1) // PAGE)
        rule_t = length_rule((used_t + KV_BLOCK - 1) // KV_BLOCK, per, cap)
        md = fa.metadata(cap, rule_t, KV_BLOCK, L, hq, hk, used_t, cu_t, PAGE)
        row["completion_entries_us"] = round(graph_us(torch, lambda: fa.paged(
            qt, cache.kc, cache.vc, table, used_t, cu_t, KV_BLOCK, L, cap, rule_t, hq, hk, md=md), 10), 1)
        emit(kind="trainer", hq=hq, hk=hk, sequences=nseq, length=L, prompt=P, entries=len(ents), rule=f"{per}/{cap}",
             **row)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="the bitwise checks (exit 1 if one does not come out as expected)")
    p.add_argument("--cost", action="store_true", help="decode and trainer-side timings")
    p.add_argument("--splits", default="1,2,4,8,16", help="split counts S to check and time")
    p.add_argument("--per", type=int, default=8, help="length rule: one split per this many 128-key blocks")
    p.add_argument("--cap", type=int, default=8, help="length rule: at most this many splits")
    p.add_argument("--json", help="append every result as a JSON line here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it runs FlashAttention-3)")
    if not (args.check or args.cost):
        p.error("say what to run: --check, --cost or both")
    splits = sorted({int(x) for x in args.splits.split(",")})
    if splits[0] < 1 or splits[-1] > 256:
        p.error(f"--splits must be within 1-256 (FA3's limit), got {args.splits}")
    try:
        length_rule(1, args.per, args.cap)
    except ValueError as e:
        p.error(str(e))
    sink = open(args.json, "a") if args.json else None

    def emit(**row):
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    fa = FA3()
    print(f"{torch.cuda.get_device_name()}; length rule: one split per {args.per} blocks of {KV_BLOCK} keys, "
          f"at most {args.cap}", flush=True)
    failed = 0
    if args.check:
        for name, (hq, hk) in HEADS.items():
            for S in splits:
                for what, (holds, expected) in check(fa, hq, hk, S, args.per, args.cap).items():
                    ok = holds == expected
                    failed += not ok
                    emit(kind="check", heads=name, S=S, check=what, equal=holds, expected_equal=expected, ok=ok)
        print(f"checks: {failed} not as expected", flush=True)
    if args.cost:
        t0 = time.perf_counter()
        decode_cost(fa, 32, 8, [1, 2, 3, 4, 8, 16, 32, 64, 128, 256], [768, 2304, 8448], splits, args.per, args.cap,
                    emit)
        decode_cost(fa, 16, 8, [1, 4, 16, 64, 256], [768, 2304, 8448], splits, args.per, args.cap, emit)
        trainer_cost(fa, 32, 8, [(1, 8192, 512), (4, 2048, 512), (16, 1024, 256), (64, 768, 512)], splits, args.per,
                     args.cap, emit)
        print(f"cost: {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
