"""DEEPINFER_ENGRAM_STOP_AT_BOS through the step metadata: the Engram spec the model builds, the
layout the worker builds, build_step_inputs, then the hashed table rows of every token."""
import pytest
import torch

from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.model_executor.layers.engram_hash import engram_indices_all
from deepinfer.model_executor.models.deepseek_v4 import make_engram_spec
from deepinfer.worker.cache_engine import cache_layout, default_block_size
from tests.support.model_helpers import tiny_config

CFG = tiny_config("v41")
BOS, EOS = CFG.bos_token_id, CFG.eos_token_ids[0]
N = CFG.engram_max_ngram_size
# Two documents packed in one sequence: BOS a b c EOS BOS d e f g (ids chosen away from BOS/EOS/pad).
TOKENS = [BOS, 900, 901, 902, EOS, BOS, 903, 904, 905, 906]
MID_BOS = 5


def _rows(monkeypatch, flag: str | None, chunks_of: list[int]) -> dict[int, torch.Tensor]:
    """Hashed rows of TOKENS per Engram layer, with the sequence fed in chunks of `chunks_of` tokens."""
    if flag is None:
        monkeypatch.delenv("DEEPINFER_ENGRAM_STOP_AT_BOS", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_ENGRAM_STOP_AT_BOS", flag)
    spec = make_engram_spec(CFG)
    bs = default_block_size(CFG)
    layout = cache_layout(CFG, 2, bs, spec)
    rows, ctx = [], 0
    for n in chunks_of:
        chunk = SeqChunk(slot=1, ctx_len=ctx, num_new=n, block_table=[1], token_ids=TOKENS)
        step = build_step_inputs([chunk], layout)
        rows.append(engram_indices_all(spec, step.ngram_ids))
        ctx += n
    return {lid: torch.cat([r[lid] for r in rows]) for lid in spec.layer_ids}


def test_option_off_leaves_every_row_unchanged(monkeypatch):
    unset = _rows(monkeypatch, None, [len(TOKENS)])
    off = _rows(monkeypatch, "0", [len(TOKENS)])
    assert unset.keys() == off.keys() and all(torch.equal(unset[k], off[k]) for k in unset)


def test_option_on_changes_only_the_lookbacks_that_cross_a_boundary(monkeypatch):
    off = _rows(monkeypatch, "0", [len(TOKENS)])
    on = _rows(monkeypatch, "1", [len(TOKENS)])
    for lid in off:
        changed = (off[lid] != on[lid]).any(dim=1).tolist()
        # Tokens before the EOS never look past a boundary; the token after the EOS (the second BOS)
        # and the first N-2 tokens after that BOS lose their lookbacks into the first document.
        crossing = set(range(MID_BOS, MID_BOS + N - 1))
        assert changed == [t in crossing for t in range(len(TOKENS))], lid


def test_reset_rows_equal_the_second_document_alone(monkeypatch):
    on = _rows(monkeypatch, "1", [len(TOKENS)])
    monkeypatch.setenv("DEEPINFER_ENGRAM_STOP_AT_BOS", "0")
    spec = make_engram_spec(CFG)
    alone = TOKENS[MID_BOS:]
    layout = cache_layout(CFG, 2, default_block_size(CFG), spec)
    step = build_step_inputs([SeqChunk(slot=1, ctx_len=0, num_new=len(alone), block_table=[1], token_ids=alone)],
                             layout)
    want = engram_indices_all(spec, step.ngram_ids)
    for lid in on:
        assert torch.equal(on[lid][MID_BOS:], want[lid])


def test_chunked_prefill_gives_the_same_rows(monkeypatch):
    whole = _rows(monkeypatch, "1", [len(TOKENS)])
    chunked = _rows(monkeypatch, "1", [4, 2, 1, 3])    # a chunk starts right at the second BOS
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)


def test_option_on_needs_a_bos_or_eos(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENGRAM_STOP_AT_BOS", "1")
    cfg = tiny_config("v41", bos_token_id=None, eos_token_ids=[])
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_STOP_AT_BOS"):
        make_engram_spec(cfg)
