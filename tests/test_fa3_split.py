"""compare/fa3_split.py's CPU parts: where FA3 keeps the split counts, the length rule, the aligned entries,
and its refusals. The GPU checks themselves: `VLLM_BATCH_INVARIANT=1 python compare/fa3_split.py --check`."""

import pytest
import torch

from compare import fa3_split


@pytest.mark.parametrize("batch, start", [(1, 4), (3, 4), (4, 4), (5, 8), (992, 992)])
def test_split_counts_follow_the_padded_seqlen_vector(batch, start):
    assert fa3_split.split_slot(batch) == slice(start, start + batch)


@pytest.mark.parametrize("batch", [0, 993])
def test_split_slot_refuses_batches_fa3_does_not_split(batch):
    with pytest.raises(ValueError, match="splits the KV range only for 1-992"):
        fa3_split.split_slot(batch)


def test_length_rule_depends_on_the_rows_block_count_alone():
    blocks = (1, 7, 8, 15, 16, 63, 64, 66, 1000)
    assert [fa3_split.length_rule(nb, 8, 8) for nb in blocks] == [1, 1, 1, 1, 2, 7, 8, 8, 8]
    blocks = torch.tensor([1, 16, 66, 1000], dtype=torch.int32)
    got = fa3_split.length_rule(blocks, 16, 4)
    assert got.dtype == torch.int32 and got.tolist() == [1, 1, 4, 4]
    with pytest.raises(ValueError, match="per and cap must be >= 1"):
        fa3_split.length_rule(5, 0, 8)


def test_aligned_entries_cut_completion_rows_where_kv_blocks_start():
    got = fa3_split.aligned_entries([100, 256, 5], [300, 300, 5])
    assert got == [(0, 100, 128), (0, 128, 256), (0, 256, 300), (1, 256, 300)]
    for s, a, e in got:  # every row of an entry has the same block count: ceil((row + 1) / 128)
        assert len({(r + 1 + 127) // 128 for r in range(a, e)}) == 1
    with pytest.raises(ValueError, match="sequence 0: prompt length 7 is not within its length 6"):
        fa3_split.aligned_entries([7], [6])


def test_refuses_to_run_without_a_gpu_or_without_a_task(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        fa3_split.main(["--check"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        fa3_split.main([])
    assert e.value.code == 2 and "--check, --cost or both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fa3_split.main(["--check", "--splits", "0,4"])
    assert e.value.code == 2 and "within 1-256" in capsys.readouterr().err


class StandInFA3:
    """FA3's two entry points on the CPU for the tool's plumbing (which rows, which keys, which pages), not for
    its numerics: a row's "output" is its query plus the sum of the values it may see (its sequence's keys up to
    its own position, by causal bottom-right alignment), its "LSE" the number of those keys. Splits change
    nothing here, so every check the tool expects equal must come out equal, and every expected difference must
    not show (those, and only those, are reported as not as expected)."""

    def __init__(self):
        self.metadata_calls = []

    def get_md(self, b, max_q, max_k, hq, hk, d, used, qkv_dtype=None, cu_seqlens_q=None, page_size=None,
               causal=True, num_splits=0):
        md = torch.zeros(4 * ((b + 3) // 4 * 4) + 1, dtype=torch.int32)
        if num_splits > 1:  # FA3 writes its own split count per sequence here (1 to num_splits)
            md[fa3_split.split_slot(b)] = torch.arange(b, dtype=torch.int32) % num_splits + 1
        self.metadata_calls.append(num_splits)
        return md

    def attn(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
             block_table=None, softmax_scale=None, causal=True, num_splits=0, fa_version=3, return_softmax_lse=True,
             scheduler_metadata=None):
        assert causal and fa_version == 3 and return_softmax_lse and (cu_seqlens_k is None) != (seqused_k is None)
        if num_splits > 1:
            md = scheduler_metadata
            b = cu_seqlens_q.numel() - 1
            assert md is not None and int(md[fa3_split.split_slot(b)].min()) >= 1
        hq, group = q.shape[1], q.shape[1] // k.shape[-2]
        out = torch.empty(q.shape, dtype=torch.float32)
        lse = torch.empty(hq, q.shape[0], dtype=torch.float32)
        for i in range(cu_seqlens_q.numel() - 1):
            q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            if block_table is None:
                vs = v[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])]
            else:
                vs = v[block_table[i].long()].flatten(0, 1)[:int(seqused_k[i])]
            seen = torch.cumsum(vs.float(), 0).repeat_interleave(group, dim=1)   # [keys, hq, d]
            last = torch.arange(q1 - q0) + vs.shape[0] - (q1 - q0)             # each row's last visible key
            assert int(last.min()) >= 0 and q1 - q0 <= max_seqlen_q and vs.shape[0] <= max_seqlen_k
            out[q0:q1] = q[q0:q1].float() + seen[last]
            lse[:, q0:q1] = (last + 1).float()
        return out, lse


def stand_in():
    """The tool's FA3 wrapper over the stand-in's two entry points, on the CPU."""
    fake = StandInFA3()
    fa = object.__new__(fa3_split.FA3)
    fa.torch, fa.attn, fa.get_md, fa.dev = torch, fake.attn, fake.get_md, torch.device("cpu")
    return fake, fa


def test_the_checks_plumbing_on_a_cpu_stand_in():
    fake, fa = stand_in()
    for S in (1, 4):
        res = fa3_split.check(fa, 4, 2, S, per=8, cap=8)
        wrong = sorted(name for name, (holds, expected) in res.items() if holds != expected)
        if S == 1:
            assert wrong == [] and not any(name.startswith("entries") for name in res)
        else:  # the stand-in does not split: exactly the expected differences fail to show
            recomputed = "entries: ruled decode rows split (S > 1) == the same rows prefilled unsplit (a recomputation)"
            assert wrong == ["chunk [1000, 5000) == trainer rows", "chunk [2064, 8300) == trainer rows",
                             "dynamic (plain vLLM's split counts): among 60 others == trainer rows", recomputed]
            assert all(holds for name, (holds, _) in res.items() if name.startswith("entries"))
            assert len([n for n in res if n.startswith("entries")]) == 5
    assert 4 in fake.metadata_calls and 16 in fake.metadata_calls


def test_the_cost_tables_plumbing_on_a_cpu_stand_in(monkeypatch):
    """decode_cost and trainer_cost with the stand-in and the timers replaced (each timed call made once)."""
    fake, fa = stand_in()
    calls = []

    def once(_torch, fn, iters):
        calls.append(fn())
        return 2.0

    monkeypatch.setattr(fa3_split, "graph_us", once)
    monkeypatch.setattr(fa3_split, "eager_us", once)
    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 0),
                        ("max_memory_allocated", 3 * 2 ** 20)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value: value)
    rows = []
    fa3_split.decode_cost(fa, 4, 2, [1, 3], [300], [1, 4], 8, 8, lambda **r: rows.append(r))
    fa3_split.trainer_cost(fa, 4, 2, [(2, 300, 100)], [1, 2], 1, 2, lambda **r: rows.append(r))
    assert [r["kind"] for r in rows] == ["decode", "decode", "trainer"]
    assert rows[1]["batch"] == 3 and rows[1]["plain_splits"] == [1, 2, 3] and rows[1]["rule_splits"] == 1
    assert set(rows[0]) >= {"S1_us", "S4_us", "plain_us"}
    t = rows[2]
    assert t["entries"] == 6 and t["prefill_S2_extra_MiB"] == 3.0 and t["completion_entries_us"] == 2.0
    assert len(calls) == 2 * 3 + 2 + 1  # per decode row: S 1, S 4, plain; two prefills; the entries
