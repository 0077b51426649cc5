"""Host-built metadata of one forward step (docs/model.md §5; docs/architecture.md §1).

The model never looks at Python sequence objects: everything it needs about which cache rows to read
and write arrives here as index tensors built on the host, so the same forward serves prefill,
chunked prefill, decode and padded static-shape graphs.

Cache addressing (see worker/cache_engine.py):
- SWA ring: per state slot `R` rows, row = slot * R + pos % R, R = W + extra_ring_rows.
- Compressor state ring: per state slot `S` rows (raw projected (c, z) of the most recent tokens),
  row = slot * S + pos % S, S = the compressor's ring + extra_ring_rows.
  extra_ring_rows > 0 with speculative decoding: the rows that rejected drafts overwrite then never
  hold a position a later step still reads (docs/model.md §5.3).
- Compressed entries (main KV and index keys): paged; a block of `block_size` tokens holds
  `block_size // m` entries of a ratio-m layer; entry w of a sequence lives at row
  block_table[w // epb] * epb + w % epb.
Rows that belong to the current step's new tokens are addressed past the end of the ring
(`ring_rows + flat token index`), so attention reads `cat([ring, new_rows])[idx]`.
"""
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.model_executor.prefix_state import PrefixStateIO, build_prefix_io


@dataclass
class SeqChunk:
    """One sequence's share of a step."""
    slot: int                 # state slot (0 = scratch, for padding rows)
    ctx_len: int              # tokens already in the cache
    num_new: int              # tokens computed this step
    block_table: list[int]    # blocks covering at least ctx_len + num_new tokens
    token_ids: list[int]      # the sequence's tokens, at least up to ctx_len + num_new
    num_logits: int = 1       # logits rows wanted (the last `num_logits` new tokens), 0 for none
    # Prefix caching (model_executor/prefix_state.py): the first restore_len positions come from cached
    # blocks (their boundary state is copied into the slot first); every block that completes at or
    # before snapshot_upto stores its boundary state.
    restore_len: int = 0
    snapshot_upto: int = 0


@dataclass
class CompressMeta:
    ratio: int
    overlap: bool
    src_idx: torch.Tensor     # [E, m or 2m] rows of cat([state_ring, new_rows]) pooled into each new entry
    src_valid: torch.Tensor   # [E, m or 2m]
    entry_pos: torch.Tensor   # [E] position of the entry (= w * m), for RoPE
    entry_dst: torch.Tensor   # [E] row in the entry pool
    state_src: torch.Tensor   # [R] new-token flat indices whose (c, z) are saved in the state ring
    state_dst: torch.Tensor   # [R]
    vis_idx: torch.Tensor     # [T, maxE] pool row of entry w (column w) for each token
    vis_valid: torch.Tensor   # [T, maxE] w < (pos + 1) // m
    n_vis: torch.Tensor       # [T]
    # The shared scope of a step with a prompt chunk (None when every chunk feeds one token: decode):
    # the pool rows of the entries the scope sequence's last row sees, and which rows belong to that
    # sequence. Such a row sees scope columns w < n_vis (a prefix, by causality), so its indexer and
    # attention read the scope gathered once instead of their own rows (docs/model.md §3.4).
    scope_idx: torch.Tensor | None = None   # [maxE]
    in_scope: torch.Tensor | None = None    # [T] bool


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    logits_indices: torch.Tensor  # [N]
    swa_idx: torch.Tensor         # [T, W] rows of cat([swa_ring, new_kv])
    swa_valid: torch.Tensor       # [T, W]
    swa_write_src: torch.Tensor   # [R]
    swa_write_dst: torch.Tensor   # [R]
    comp: dict = field(default_factory=dict)  # (ratio, ring, overlap) -> CompressMeta
    ngram_ids: torch.Tensor | None = None      # [T, N] compressed ids of tokens t, t-1, ... (pad before start)
    engram_rows: torch.Tensor | None = None    # [L_engram, T, K * d] table rows the host gathered from the
                                               # ngram_ids (layers/engram_host.py), which it then drops
    token_valid: torch.Tensor | None = None    # [T] bool: False for placeholder rows (state slot 0), which
                                               # select no expert (docs/neuron.md §5.3); None = all real
    prefix: PrefixStateIO | None = None        # prefix-cache state copies (model_executor/prefix_state.py)
    static_shapes: bool = False                # padded to a bucket (model_executor/static_step.py): the forward
                                               # must use fixed-shape, sync-free kernels (routed MoE)
    seq_scopes: tuple | None = None            # ((start, end), ...) rows of each real chunk feeding at least
                                               # SEQ_SCOPE_MIN_ROWS tokens: an eager step gives each its own
                                               # scope (CompressMeta's covers one; layers/row_chunks.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class CacheLayout:
    """What the metadata builder needs to know about the model's caches."""
    window: int
    num_slots: int
    block_size: int
    compressors: list[tuple[int, int, bool]]  # (ratio, state ring rows, overlap)
    engram: object = None                     # EngramHashSpec when the model has Engram layers
    extra_ring_rows: int = 0                  # rows per slot added to every ring (speculative backtracking)

    @property
    def swa_ring(self) -> int:
        return self.window + self.extra_ring_rows

    def state_ring(self, ring: int) -> int:
        return ring + self.extra_ring_rows


def _pool_rows(tables: np.ndarray, seq_of: np.ndarray, w: np.ndarray, epb: int) -> np.ndarray:
    blk_col = np.minimum(w // epb, tables.shape[1] - 1)
    blk = tables[seq_of, blk_col] if tables.size else np.zeros_like(w)
    return blk * epb + w % epb


def _scope_rows(chunks: list[SeqChunk], start: np.ndarray, token_seq: np.ndarray):
    """(flat index of the scope sequence's last row, [T] rows of that sequence), or (None, None) when
    every chunk feeds one token. The scope sequence is the real chunk (slot != 0) feeding the most
    tokens, the first of equals; a step of placeholders only (warm-up) takes its first longest chunk.
    Whether a step has a scope depends only on its chunk sizes, so every step of a bucket agrees."""
    if all(c.num_new <= 1 for c in chunks):
        return None, None
    real = [b for b, c in enumerate(chunks) if c.slot != 0] or list(range(len(chunks)))
    b = max(real, key=lambda i: (chunks[i].num_new, -i))
    return int(start[b]) + chunks[b].num_new - 1, token_seq == b


# Fewest rows for which a chunk of an eager step reads its own scope: each scope costs a few ops a
# layer, which short chunks do not repay. Measured (tiny V4, eager prefill, one thread): 4 prompts of
# 512 tokens 1.5x faster with their own scopes, 32 of 64 the same, 32 of 8 15-20 % slower.
SEQ_SCOPE_MIN_ROWS = 64


def _seq_scopes(chunks: list[SeqChunk], start: np.ndarray) -> tuple[tuple[int, int], ...] | None:
    """[start, end) rows of every real chunk feeding at least SEQ_SCOPE_MIN_ROWS tokens, in row
    order; None when there is none (the step then reads CompressMeta's one scope)."""
    out = tuple((int(start[b]), int(start[b]) + c.num_new) for b, c in enumerate(chunks)
                if c.slot != 0 and c.num_new >= SEQ_SCOPE_MIN_ROWS)
    return out or None


def build_step_inputs(chunks: list[SeqChunk], layout: CacheLayout, shared_scope: bool = True,
                      seq_scopes: bool = True) -> StepInputs:
    """The step's metadata; `shared_scope=False` leaves out the prompt chunk's shared scope (every row
    then reads its own gathers, the same values): static_step.BucketSpec.static_step does so for a
    bucket of a decode bucket's token count, whose graphs have no scope. `seq_scopes=False` leaves
    out the per-sequence scopes an eager step reads (a graph's inputs must not vary with its rows'
    sequences: static_step leaves them out).

    The index arithmetic runs in NumPy and the results become tensors without a copy
    (torch.from_numpy): it is ~100 operations on arrays of a few to a few thousand integers, where a
    torch call's dispatch cost dominates (0.62 ms of a ~7 ms compiled batch-1 decode step of the
    trained tiny V4.1 in torch; README "Compiled CPU decode step", the host's share of a step). Integer
    semantics are the same in both: floor division, floor modulo (`%` on non-negative divisors),
    int64 throughout."""
    nb = len(chunks)
    ctx = np.fromiter((c.ctx_len for c in chunks), dtype=np.int64, count=nb)
    new = np.fromiter((c.num_new for c in chunks), dtype=np.int64, count=nb)
    slot = np.fromiter((c.slot for c in chunks), dtype=np.int64, count=nb)
    start = np.cumsum(new) - new
    t = int(new.sum())
    token_seq = np.repeat(np.arange(nb, dtype=np.int64), new)
    positions = ctx[token_seq] + (np.arange(t, dtype=np.int64) - start[token_seq])
    ids = []
    for c in chunks:
        ids.extend(c.token_ids[c.ctx_len:c.ctx_len + c.num_new])
    logits = []
    for b, c in enumerate(chunks):
        k = min(c.num_logits, c.num_new)
        end = int(start[b]) + c.num_new
        logits.extend(range(end - k, end))
    max_blocks = max([len(c.block_table) for c in chunks] + [1])
    tables = np.zeros((nb, max_blocks), dtype=np.int64)
    for b, c in enumerate(chunks):
        tables[b, :len(c.block_table)] = c.block_table

    tok_slot = slot[token_seq]
    token_valid = tok_slot != 0   # slot 0 is scratch: only placeholder chunks (static_step.pad_chunks) use it
    end_pos = (ctx + new)[token_seq]

    def addr(p: np.ndarray, ring: int, ring_rows: int, seq_of=None) -> np.ndarray:
        """Row of position p: past tokens in the ring, this step's tokens after the ring."""
        s = token_seq if seq_of is None else seq_of
        in_step = p >= ctx[s]
        ring_row = slot[s] * ring + p % ring
        new_row = ring_rows + start[s] + (p - ctx[s])
        return np.where(in_step, new_row, ring_row)

    w, swa_ring = layout.window, layout.swa_ring
    ring_rows = layout.num_slots * swa_ring
    kp = positions[:, None] - (w - 1) + np.arange(w, dtype=np.int64)[None, :]
    swa_valid = kp >= 0
    kpc = np.maximum(kp, 0)
    swa_idx = addr(kpc, swa_ring, ring_rows, token_seq[:, None])
    keep = positions >= end_pos - w
    swa_write_src = np.flatnonzero(keep)
    swa_write_dst = tok_slot[keep] * swa_ring + positions[keep] % swa_ring

    scope_last, in_scope = _scope_rows(chunks, start, token_seq) if shared_scope else (None, None)
    comp = {}
    for (m, spec_ring, overlap) in layout.compressors:
        ring = layout.state_ring(spec_ring)
        epb = layout.block_size // m
        assert epb * m == layout.block_size, "block_size must be a multiple of every compress ratio"
        w0 = ctx // m
        w1 = (ctx + new) // m
        ne = np.maximum(w1 - w0, 0)
        e_seq = np.repeat(np.arange(nb, dtype=np.int64), ne)
        e_w = w0[e_seq] + (np.arange(int(ne.sum()), dtype=np.int64) - (np.cumsum(ne) - ne)[e_seq])
        offs = np.arange(m, dtype=np.int64)
        src_pos = e_w[:, None] * m + offs[None, :]
        valid = np.ones(src_pos.shape, dtype=bool)
        if overlap:
            a_pos = (e_w[:, None] - 1) * m + offs[None, :]
            valid = np.concatenate([a_pos >= 0, valid], axis=1)
            src_pos = np.concatenate([np.maximum(a_pos, 0), src_pos], axis=1)
        state_rows = layout.num_slots * ring
        src_idx = np.where(valid, addr(src_pos, ring, state_rows, e_seq[:, None]), 0)
        entry_dst = _pool_rows(tables, e_seq, e_w, epb)
        skeep = positions >= end_pos - ring
        n_vis = (positions + 1) // m
        max_e = int(n_vis.max()) if t else 0
        wcol = np.broadcast_to(np.arange(max_e, dtype=np.int64)[None, :], (t, max_e))
        vis_valid = wcol < n_vis[:, None]
        vis_idx = np.where(vis_valid, _pool_rows(tables, token_seq[:, None], wcol, epb), 0)
        comp[(m, spec_ring, overlap)] = CompressMeta(
            ratio=m, overlap=overlap, src_idx=_tensor(src_idx), src_valid=_tensor(valid),
            entry_pos=_tensor(e_w * m), entry_dst=_tensor(entry_dst),
            state_src=_tensor(np.flatnonzero(skeep)),
            state_dst=_tensor(tok_slot[skeep] * ring + positions[skeep] % ring),
            vis_idx=_tensor(vis_idx), vis_valid=_tensor(vis_valid), n_vis=_tensor(n_vis),
            scope_idx=_tensor(vis_idx[scope_last]) if scope_last is not None else None,
            in_scope=_tensor(in_scope) if in_scope is not None else None)

    ngram_ids = None
    if layout.engram is not None:
        ngram_ids = layout.engram.batch_ngram_ids([(c.token_ids, c.ctx_len, c.num_new) for c in chunks])

    return StepInputs(input_ids=torch.tensor(ids, dtype=torch.long), positions=_tensor(positions),
                      logits_indices=torch.tensor(logits, dtype=torch.long), swa_idx=_tensor(swa_idx),
                      swa_valid=_tensor(swa_valid), swa_write_src=_tensor(swa_write_src),
                      swa_write_dst=_tensor(swa_write_dst),
                      comp=comp, ngram_ids=ngram_ids, token_valid=_tensor(token_valid),
                      prefix=build_prefix_io(chunks, layout, _tensor(ctx), _tensor(start)),
                      seq_scopes=_seq_scopes(chunks, start) if seq_scopes and scope_last is not None else None)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A contiguous int64 / bool tensor sharing `a`'s memory (a fresh array: nothing else holds it)."""
    return torch.from_numpy(np.ascontiguousarray(a))


def step_to(step: StepInputs, device) -> StepInputs:
    """Copy every tensor of a step to `device` (no-op when the step is there already)."""
    device = torch.device(device)
    if step.input_ids.device == device:
        return step

    def move(v):
        return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v

    def move_fields(obj):
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    comp = {k: move_fields(m) for k, m in step.comp.items()}
    prefix = step.prefix
    if prefix is not None:
        prefix = PrefixStateIO(move_fields(prefix.swa), {k: move_fields(c) for k, c in prefix.comp.items()})
    fields = {f.name: move(getattr(step, f.name)) for f in dataclasses.fields(step)
              if f.name not in ("comp", "prefix")}
    return dataclasses.replace(step, comp=comp, prefix=prefix, **fields)
