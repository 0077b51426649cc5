"""The draft vocabulary's file, ranking and column layout (model_executor/models/draft_vocab.py): ids
sorted and distinct, bad files refused with the reason, the most frequent tokens kept (ties to the
lowest id), and columns that hold ascending ids with masked pads, on one head and on a head split over
a CP group."""
import json
from types import SimpleNamespace

import pytest
import torch

from deepinfer.model_executor.models.draft_vocab import PAD_TO, DraftColumns, DraftVocab, rank_tokens, read_draft_vocab


def _write(tmp_path, doc) -> str:
    p = tmp_path / "vocab.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_read_sorts_and_dedups(tmp_path):
    assert read_draft_vocab(_write(tmp_path, {"token_ids": [9, 3, 3, 0]}), 10) == [0, 3, 9]


@pytest.mark.parametrize("doc, message", [
    ("not json", "cannot read"),
    ({"ids": [1]}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ([1, 2], "token_ids"),
    ({"token_ids": [1, 10]}, r"\[0, 10\)"),
    ({"token_ids": [-1]}, r"\[0, 10\)"),
    ({"token_ids": [1.0]}, "ints"),
    ({"token_ids": [True]}, "ints"),
])
def test_read_refuses_bad_files(tmp_path, doc, message):
    with pytest.raises(ValueError, match=message):
        read_draft_vocab(_write(tmp_path, doc), 10)


def test_read_refuses_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_draft_vocab(str(tmp_path / "absent.json"), 10)


def test_rank_keeps_the_most_frequent_ties_to_the_lowest_id():
    counts = {7: 5, 2: 3, 9: 3, 4: 3, 1: 1}
    assert rank_tokens(counts, 1) == [7]
    assert rank_tokens(counts, 3) == [2, 4, 7]        # 2 and 4 before 9 at equal counts
    assert rank_tokens(counts, 99) == [1, 2, 4, 7, 9]
    with pytest.raises(ValueError):
        rank_tokens(counts, 0)


def test_columns_of_one_head_pad_to_whole_tiles():
    ids = [3, 5, 40, 41, 99]
    cols = DraftColumns.build(ids)
    assert cols.ids.numel() == PAD_TO and cols.ids[:5].tolist() == ids
    assert torch.equal(cols.mask[:5], torch.zeros(5)) and bool(torch.isinf(cols.mask[5:]).all())
    assert cols.real.tolist() == [0, 1, 2, 3, 4]
    assert cols.local_rows[:5].tolist() == ids and cols.local_real.tolist() == [True] * 5 + [False] * 11


def test_columns_of_a_split_head_are_rank_blocks_in_ascending_ids():
    vocab, world = 64, 4
    ids = [1, 2, 17, 18, 19, 20, 40, 63]              # rank 0: 2 ids, rank 1: 4, rank 2: 1, rank 3: 1
    per_rank = []
    for r in range(world):
        shard = SimpleNamespace(start=r * vocab // world, size=vocab // world, vocab=vocab, world=world)
        per_rank.append(DraftColumns.build(ids, shard))
    cols = per_rank[0]
    m = PAD_TO                                         # the widest rank's 4 ids, padded to a tile
    assert cols.ids.numel() == world * m
    real_ids = cols.ids[cols.real].tolist()
    assert real_ids == ids                             # ascending through the gathered columns
    assert bool(torch.isinf(cols.mask[cols.mask != 0]).all()) and int((cols.mask == 0).sum()) == len(ids)
    for r, c in enumerate(per_rank):                   # every rank agrees on the columns, holds its own rows
        assert torch.equal(c.ids, cols.ids) and torch.equal(c.mask, cols.mask)
        own = [t - r * 16 for t in ids if r * 16 <= t < (r + 1) * 16]
        assert c.local_rows[:len(own)].tolist() == own and int(c.local_real.sum()) == len(own)


def test_expand_puts_column_logits_at_their_ids_and_minus_inf_elsewhere():
    ids = [2, 5, 7]
    cols = DraftColumns.build(ids)
    dv = DraftVocab(cols, torch.zeros(PAD_TO, 4), torch.zeros(PAD_TO, 2))
    logits = torch.full((2, PAD_TO), float("-inf"))
    logits[:, :3] = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    full = dv.expand(logits, 10)
    assert full.shape == (2, 10)
    assert full[:, ids].tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    others = [t for t in range(10) if t not in ids]
    assert bool(torch.isinf(full[:, others]).all())


def test_dense_rows_select_rows_zero_pads_keep_fp32_column_order_and_refuse_packed_heads():
    from torch import nn

    from deepinfer.model_executor.layers.packed_weights import PackedFp8Linear, WeightFormat
    from deepinfer.model_executor.models.draft_vocab import dense_rows
    lin = nn.Linear(4, 10, bias=False)
    out = dense_rows(lin, torch.tensor([3, 7, 0]), torch.tensor([True, True, False]), torch.float32)
    assert torch.equal(out[:2], lin.weight.detach()[[3, 7]]) and torch.equal(out[2], torch.zeros(4))
    assert out.stride() == (1, 3)      # [in, out] memory order, as every fp32 linear after loading
    packed = PackedFp8Linear(128, 128, WeightFormat("fp8", (128, 128)))
    with pytest.raises(ValueError, match="dense LM and Markov heads"):
        dense_rows(packed, torch.tensor([0]), torch.tensor([True]), torch.float32)
