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
