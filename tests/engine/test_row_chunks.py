"""Row chunks of the indexer and the attention (model_executor/layers/row_chunks.py): a prompt run
in chunks of rows gives every row the same logits, bit for bit, as one chunk of all rows, on both
tiny checkpoints (the V4.1 run selects sparsely and uses the candidate-block filter)."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.layers import indexer, row_chunks
from deepinfer.model_executor.models import v4_attention
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import run_chunks


def _ids(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 128000, (n - 1,), generator=g).tolist()


def test_row_chunks_are_powers_of_two_within_the_budget():
    assert row_chunks.row_chunks(10, 1 << 20, budget=4 << 20) == [(0, 4), (4, 8), (8, 10)]
    assert row_chunks.row_chunks(10, 1 << 20, budget=5 << 20) == [(0, 4), (4, 8), (8, 10)]
    assert row_chunks.row_chunks(3, 1 << 20, budget=64 << 20) == [(0, 3)]
    assert row_chunks.row_chunks(5, 1 << 30, budget=1) == [(i, i + 1) for i in range(5)]


def test_candidate_entry_mask_matches_the_comparison_form():
    g = torch.Generator().manual_seed(0)
    for entries, block in ((37, 8), (64, 8), (5, 4), (0, 8)):
        nblk = max(1, -(-entries // block))
        cand = torch.randint(-1, nblk + 2, (6, 4), generator=g)
        blk_of = torch.arange(entries) // block
        want = (blk_of[None, :, None] == cand[:, None, :]).any(dim=-1)
        assert torch.equal(indexer.candidate_entry_mask(cand, entries, block), want)


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_prompt_rows_in_chunks_give_the_same_logits(request, kind, monkeypatch):
    ckpt = request.getfixturevalue("tiny_v4_dir" if kind == "v4" else "tiny_v41_dir")
    cfg = ModelConfig.from_pretrained(ckpt)
    model = build_model(cfg, str(ckpt), torch.float32, progress=False)
    ids = _ids(120)
    whole = run_chunks(model, ids, [120])
    sizes = []
    real = v4_attention.row_chunks

    def spy(rows, per_row, budget=None):
        out = real(rows, per_row, budget=16 * per_row)      # chunks of 16 rows
        sizes.append(len(out))
        return out
    monkeypatch.setattr(v4_attention, "row_chunks", spy)
    chunked = run_chunks(model, ids, [120])
    assert sizes and min(sizes) == 120 // 16 + 1
    # every op is row-wise and each row's ops see the same shapes per row: the same bits
    assert torch.equal(chunked, whole)
