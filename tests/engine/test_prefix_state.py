"""The per-slot state of a cached prefix (model_executor/prefix_state.py) on the real tiny models: a
sequence that starts from another's cached blocks gets, in its slot, exactly the ring rows it would
have computed itself (every SWA ring, draft layers included, and every overlapping compressor's state),
and its logits equal bit for bit those of a sequence that computed the prefix in the same chunk shapes."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor import prefix_state
from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.worker.worker import build_model

PREFIX, TOTAL = 32, 45


def _model(model_dir, drafting: bool):
    cfg = ModelConfig.from_pretrained(model_dir)
    model = build_model(cfg, str(model_dir), torch.float32, progress=False)
    if drafting:
        model.enable_drafting()
    return cfg, model


def _slot_rows(cache, layout, slot: int, positions) -> dict:
    """Every ring's rows of `positions` in `slot`: SWA rings, and the state rings the snapshots cover."""
    out = {}
    for layer, ring in cache.swa.items():
        r = layout.swa_ring
        out[("swa", layer)] = ring[[slot * r + p % r for p in positions]].clone()
    for key, spec in cache.state_snap_spec.items():
        s = layout.state_ring(spec[1])
        out[key] = cache.comp_state[key][[slot * s + p % s for p in positions[-spec[0]:]]].clone()
    return out


@pytest.mark.parametrize("kind,mode,drafting", [("v4", "plain", False), ("v4", "compact", False),
                                                ("v41", "plain", True), ("v41", "compact", True)])
def test_restored_slot_equals_a_computed_one(tiny_v4_dir, tiny_v41_dir, kind, mode, drafting):
    cfg, model = _model(tiny_v4_dir if kind == "v4" else tiny_v41_dir, drafting)
    bs = default_block_size(cfg)
    assert PREFIX % bs == 0
    layout = cache_layout(cfg, 4, bs, model.engram_spec)
    cache = allocate_cache(cfg, 4, 12, bs, torch.float32, mode=mode, prefix_snapshots=True)
    # V4's CSA compressors (and their indexers') overlap windows; V4.1's compressors never do
    assert bool(cache.state_snap) == (kind == "v4")
    if drafting:
        assert len(cache.swa_snap) == cfg.num_layers + cfg.num_nextn_predict_layers
    g = torch.Generator().manual_seed(1)
    ids = [0] + torch.randint(3, 128000, (TOTAL - 1,), generator=g).tolist()

    def run(chunk):
        return model(build_step_inputs([chunk], layout), cache)

    # the reference computes everything in slot 1; the producer computes the prefix in slot 2 (the
    # same first chunk) and snapshots its blocks; the consumer starts in slot 3 from the producer's blocks
    run(SeqChunk(1, 0, PREFIX, [1, 2, 3], ids, 1))
    run(SeqChunk(2, 0, PREFIX, [4, 5, 6], ids, 1, snapshot_upto=PREFIX))
    consumer = SeqChunk(3, PREFIX, TOTAL - PREFIX, [4, 5, 7], ids, TOTAL - PREFIX, restore_len=PREFIX)
    step = build_step_inputs([consumer], layout)
    window = list(range(PREFIX - cfg.sliding_window, PREFIX))
    before = _slot_rows(cache, layout, 3, window)
    prefix_state.restore(step.prefix, cache)
    restored, want = _slot_rows(cache, layout, 3, window), _slot_rows(cache, layout, 1, window)
    for key in want:
        assert torch.equal(restored[key], want[key]), key
        if not torch.equal(before[key], want[key]):
            continue
        pytest.fail(f"{key}: the slot held the right rows before the restore (the test proves nothing)")
    got = model(step, cache)
    ref = run(SeqChunk(1, PREFIX, TOTAL - PREFIX, [1, 2, 3], ids, TOTAL - PREFIX))
    assert torch.equal(got, ref)


def test_snapshot_rows_of_blocks_completed_across_chunks(tiny_v41_dir):
    """A block that completes in a later chunk than it began takes its earlier rows from the ring."""
    cfg, model = _model(tiny_v41_dir, False)
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 4, bs, model.engram_spec)
    cache = allocate_cache(cfg, 4, 12, bs, torch.float32, prefix_snapshots=True)
    ids = list(range(7, 7 + TOTAL))
    for slot, table, cuts in ((1, [1, 2, 3], (0, PREFIX)), (2, [4, 5, 6], (0, 13, 29, PREFIX))):
        for a, b in zip(cuts, cuts[1:]):
            model(build_step_inputs([SeqChunk(slot, a, b - a, table, ids, 1, snapshot_upto=PREFIX)], layout),
                  cache)
    # slot 2's block 0 completes in its [13, 29) chunk, rows 8..12 of its snapshot from the ring. Layer 0's
    # keys depend on the token alone; later layers' on the chunk shapes too, to the rounding (~1e-6)
    sw = min(cfg.sliding_window, bs)
    for layer, store in cache.swa_snap.items():
        if layer >= cfg.num_layers:
            continue   # draft layers: written only once drafting is on
        one_chunk, three = store[1 * sw:3 * sw], store[4 * sw:6 * sw]
        assert three.abs().sum() > 0
        if layer == 0:
            assert torch.equal(one_chunk, three)
        torch.testing.assert_close(three, one_chunk, rtol=0, atol=1e-4, msg=f"layer {layer}")
