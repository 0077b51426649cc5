"""Attention of the V4 / V4.1 decoder (docs/model.md §3.3-3.5): sliding window, the compressors of
CSA / HCA (V4) and C1 / C2 (V4.1), the lightning indexer and sparse top-k selection, V4.1 KV /
index sharing, candidate blocks and YOCO."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed import comm
from deepinfer.model_executor.checkpoint_formats import F32, FP8, stored_as
from deepinfer.model_executor import prefix_state
from deepinfer.model_executor.layers.compressor import gather_overlap_slots
from deepinfer.model_executor.layers.concat_rows import concat_rows, concat_sources
from deepinfer.model_executor.layers.indexer import candidate_blocks, candidate_entry_mask, stable_topk
from deepinfer.model_executor.layers.packed_weights import grouped_mm, linear_mm
from deepinfer.model_executor.layers.row_chunks import row_chunks, scope_branch, scope_chunks
from deepinfer.model_executor.models.v4_common import LayerIO, Norm, StepContext, f32_param, linear


def compressor_spec(cfg, layer: int) -> tuple[int, int, bool] | None:
    """(ratio, state ring rows, overlap) of the compressor owned by `layer`, None if it owns none."""
    m = cfg.compress_ratios[layer]
    if m == 0:
        return None
    if cfg.is_v41:
        if cfg.kv_source_map[layer] != layer:
            return None
        return (m, m, False)
    overlap = cfg.layer_kinds[layer] == "csa"
    return (m, 2 * m if overlap else m, overlap)


def _eager_seq_scopes(ctx: StepContext) -> tuple | None:
    """The step's per-sequence scopes when it runs eagerly (forward_meta.StepInputs.seq_scopes), else
    None: a padded or traced step reads CompressMeta's one scope (layers/row_chunks.py)."""
    step = ctx.step
    if step.seq_scopes is None or step.static_shapes or torch.compiler.is_compiling():
        return None
    return step.seq_scopes


class Compressor(nn.Module):
    def __init__(self, dim: int, width: int, ratio: int, overlap: bool, gated: bool, ape: bool, dtype,
                 out_norm: int):
        super().__init__()
        mult = 2 if overlap else 1
        self.width, self.ratio, self.overlap = width, ratio, overlap
        self.wkv = linear(dim, mult * width, dtype)
        self.wgate = linear(dim, mult * width, dtype) if gated else None
        self.ape = nn.Parameter(torch.zeros(ratio, mult * width, dtype=dtype)) if ape else None
        if ape:
            stored_as(F32, self, "ape")   # TF keeps position_bias in fp32; the model adds it in its dtype
        self.norm = Norm(out_norm, dtype)

    def project(self, h: torch.Tensor, positions: torch.Tensor, fp32_out: bool) -> torch.Tensor:
        """Rows [c | z] saved per token in the state ring (z = 0 for ungated C1)."""
        hx = h.float() if fp32_out else h
        c = hx @ self.wkv.weight.to(hx.dtype).t()
        if self.wgate is None:
            return torch.cat([c, torch.zeros_like(c)], dim=-1)
        z = hx @ self.wgate.weight.to(hx.dtype).t()
        if self.ape is not None:
            z = z + self.ape[positions % self.ratio].to(z.dtype)
        return torch.cat([c, z], dim=-1)


class Indexer(nn.Module):
    def __init__(self, cfg, layer: int, dtype):
        super().__init__()
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = stored_as(FP8, linear(cfg.q_lora_rank, n_i * d_i, dtype))
        self.weights_proj = linear(cfg.hidden_size, n_i, dtype)
        if cfg.is_v41:
            if cfg.index_k_source_map[layer] == layer:
                self.wk = linear(cfg.head_dim, d_i, dtype)
                self.k_norm = Norm(d_i, dtype)
        else:
            m = cfg.compress_ratios[layer]
            self.compressor = Compressor(cfg.hidden_size, d_i, m, True, True, True, dtype, d_i)


class Attention(nn.Module):
    def __init__(self, cfg, layer: int, dtype, draft: bool = False, heads=None, lane=None):
        """heads: this rank's HeadShard (model_executor/shard_plan.py) when attention is split over a
        lane, None for all heads; lane: the lane's process group, over which the partial outputs are
        summed (docs/neuron.md §5.6)."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d = cfg.head_dim
        # local heads and output groups; wo_a's input width is one group's (or, for part of a group,
        # this rank's heads' share of it)
        self.n_heads = cfg.num_heads if heads is None else heads.heads
        self.n_groups = cfg.o_groups if heads is None else heads.groups
        group_in = cfg.num_heads * d // cfg.o_groups if heads is None else heads.cols
        self.lane = lane
        # the projections upstream DeepInfer builds with use_fp8_gemm are stored fp8 (docs/model.md §2.1)
        self.wq_a = stored_as(FP8, linear(cfg.hidden_size, cfg.q_lora_rank, dtype))
        self.q_norm = Norm(cfg.q_lora_rank, dtype)
        self.wq_b = stored_as(FP8, linear(cfg.q_lora_rank, self.n_heads * d, dtype))
        self.wkv = stored_as(FP8, linear(cfg.hidden_size, d, dtype))
        self.kv_norm = Norm(d, dtype)
        self.wo_a = stored_as(FP8, linear(group_in, self.n_groups * cfg.o_lora_rank, dtype))
        self.wo_b = stored_as(FP8, linear(self.n_groups * cfg.o_lora_rank, cfg.hidden_size, dtype))
        self.attn_sink = f32_param(self.n_heads)
        self.ratio = 0 if draft else cfg.compress_ratios[layer]
        self.rope_kind = "main" if self.ratio == 0 else "compress"
        spec = None if draft else compressor_spec(cfg, layer)
        self.comp_key = spec
        if spec is not None:
            m, _, overlap = spec
            if cfg.is_v41:
                self.compressor = Compressor(cfg.hidden_size, d, m, False, m > 1, False, dtype, d)
            else:
                self.compressor = Compressor(cfg.hidden_size, d, m, overlap, True, True, dtype, d)
        self.is_index_source = False
        # Static facts of the layer read by the forward instead of its layer id (region sharing).
        self.kind = "swa" if draft else cfg.layer_kinds[layer]
        self.src_comp_key = None       # compressor spec of the layer whose entries we read
        self.uses_shared_hidden = False
        self.candidate_source = self.candidate_consumer = False
        if not draft and self.ratio > 0:
            self.src_comp_key = compressor_spec(cfg, cfg.kv_source_map[layer] if cfg.is_v41 else layer)
            if cfg.is_v41:
                self.is_index_source = cfg.index_source_map[layer] == layer
                self.uses_shared_hidden = layer > cfg.n_prefill_layer
                c_src = cfg.candidate_source_layer_id
                self.candidate_source = c_src is not None and layer == c_src
                self.candidate_consumer = c_src is not None and layer > c_src
            else:
                self.is_index_source = cfg.layer_kinds[layer] == "csa"
            if self.is_index_source:
                self.indexer = Indexer(cfg, layer, dtype)

    # -- compressed-entry production ---------------------------------------------------------
    def _pool(self, comp: "Compressor", rows: torch.Tensor, state: torch.Tensor, meta, ctx: StepContext,
              out_dtype: torch.dtype, snap: torch.Tensor | None = None) -> torch.Tensor | None:
        """Pool the windows that complete this step from cat([state ring, this step's rows]) into
        normalised pre-RoPE entries (None when none completes), and save the rows later windows need
        (and, into `snap`, the rows of the blocks this step completes: model_executor/prefix_state.py)."""
        latent = None
        # rows of cat([state ring, this step's rows]): built once when that is the cheaper move (a prompt
        # step), else gathered from the two (layers/concat_rows.py); the pooling and the snapshot share it
        src = concat_sources(state, rows, meta.src_idx.numel() if meta.entry_dst.numel() else 0)
        if meta.entry_dst.numel():
            c, z = gather_overlap_slots(src[0], meta.src_idx, comp.width, comp.overlap, new=src[1])
            pooled = ctx.k.compress_pool(c, z, meta.src_valid).to(out_dtype)
            latent = ctx.k.rms_norm(pooled, comp.norm.weight, self.cfg.rms_norm_eps)
        if snap is not None and ctx.step.prefix is not None:
            prefix_state.snapshot(snap, ctx.step.prefix.comp.get(self.comp_key), *src)
        if meta.state_dst.numel():
            state[meta.state_dst] = rows[meta.state_src].to(state.dtype)
        return latent

    def _compress(self, h_src: torch.Tensor, ctx: StepContext, io: LayerIO):
        cfg, step = self.cfg, ctx.step
        meta = step.comp[self.comp_key]
        rows = self.compressor.project(h_src, step.positions, fp32_out=cfg.is_v41)
        latent = self._pool(self.compressor, rows, io.state, meta, ctx, h_src.dtype, io.state_snap)
        cos, sin = ctx.entry_rope(self.comp_key)
        if latent is not None:
            io.entries[meta.entry_dst] = io.fmt.entries.encode(ctx.k.rope(latent, cos, sin))
        if not cfg.is_v41 and self.is_index_source:
            # V4 index keys: the indexer's own overlapping compressor over the same windows
            icomp = self.indexer.compressor
            irows = icomp.project(h_src, step.positions, fp32_out=False)
            keys = self._pool(icomp, irows, io.index_state, meta, ctx, h_src.dtype, io.index_state_snap)
        elif cfg.is_v41 and latent is not None and hasattr(self, "indexer") and hasattr(self.indexer, "wk"):
            # V4.1 index keys: projected from the pre-RoPE latent
            keys = ctx.k.rms_norm(latent @ self.indexer.wk.weight.t(), self.indexer.k_norm.weight,
                                  cfg.rms_norm_eps)
        else:
            keys = None
        if keys is not None:
            io.index_keys[meta.entry_dst] = io.fmt.index.encode(ctx.k.rope(keys, cos, sin))

    # -- sparse selection ----------------------------------------------------------------------
    def _select(self, h: torch.Tensor, cq: torch.Tensor, ctx: StepContext, meta, io: LayerIO) -> torch.Tensor:
        """Entry columns (w) selected per token, [T, k] with -1 for none."""
        cfg = self.cfg
        if not cfg.is_v41 and self.kind == "hca":
            wcol = torch.arange(meta.vis_idx.shape[1], device=meta.vis_idx.device)[None, :].expand_as(meta.vis_idx)
            return torch.where(meta.vis_valid, wcol, torch.full_like(wcol, -1))
        if not self.is_index_source:
            return io.topk
        t = h.shape[0]
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        q = linear_mm(cq, self.indexer.wq_b, ctx.k).view(t, n_i, d_i)
        cos, sin = ctx.rope("compress")
        q = ctx.k.rope(q, cos[:, None], sin[:, None])
        w = (h @ self.indexer.weights_proj.weight.t()).float()
        # a row's intermediates: its decoded keys [E, dI] (own rows only) and head scores [nI, E] in
        # fp32, the sort's values and int64 indices [E] (row_chunks.py: rows in chunks, every row's
        # result unchanged)
        e = meta.vis_idx.shape[1]
        own_row = e * (d_i + n_i + 3) * 4
        # decode: every row gathers its own keys
        if meta.scope_idx is None:
            parts = [self._index_rows(self._scores(q[a:b], w[a:b], self._own_keys(meta.vis_idx[a:b], io),
                                                   meta.vis_valid[a:b], ctx), meta, io, slice(a, b))
                     for a, b in row_chunks(t, own_row)]
        elif (scopes := _eager_seq_scopes(ctx)) is not None:
            # an eager step with prompt chunks: each chunk's rows score the keys its last row sees,
            # gathered and decoded once a chunk; decode rows between them gather their own
            scope_of, parts = (None, None), []   # (last row, its scope): ranges come in row order
            for a, b, last in scope_chunks(t, e * (n_i + 3) * 4, own_row, scopes):
                if last is None:
                    keys = self._own_keys(meta.vis_idx[a:b], io)
                else:
                    if scope_of[0] != last:
                        scope_of = (last, io.fmt.index.decode(io.index_keys[meta.vis_idx[last]], torch.float32))
                    keys = scope_of[1]
                parts.append(self._index_rows(self._scores(q[a:b], w[a:b], keys, meta.vis_valid[a:b], ctx),
                                              meta, io, slice(a, b)))
        else:
            # a prompt chunk: the keys its last row sees, gathered and decoded once; each row scores
            # them all and keeps its causal prefix by vis_valid (docs/model.md §3.4)
            scope = io.fmt.index.decode(io.index_keys[meta.scope_idx], torch.float32)
            parts = [self._index_rows(self._scoped_scores(q[a:b], w[a:b], scope, meta, io, slice(a, b), ctx, own_row),
                                      meta, io, slice(a, b)) for a, b in row_chunks(t, e * (n_i + 3) * 4)]
        sel = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
        if self.candidate_source:
            io.candidates_out = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        io.topk_out = sel
        return sel

    def _own_keys(self, vis_idx: torch.Tensor, io: LayerIO) -> torch.Tensor:
        """Each row's visible index keys, gathered per row: [rows, E, dI] fp32."""
        return io.fmt.index.decode(io.index_keys[vis_idx], torch.float32)

    def _scores(self, q, w, keys, vis_valid, ctx: StepContext) -> torch.Tensor:
        """Indexer scores [rows, E] of some rows over their keys ([rows, E, dI]) or a shared scope ([E, dI])."""
        cfg = self.cfg
        if cfg.is_v41:
            return ctx.k.index_scores(q, keys, w, vis_valid)
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        return ctx.k.index_scores(q, keys, w * n_i ** -0.5, vis_valid, key_scale=d_i ** -0.5)

    def _scoped_scores(self, q, w, scope, meta, io: LayerIO, rows: slice, ctx: StepContext, own_row: int):
        """Scores of some rows of a step with a scope: over the shared scope when every row is the
        scope sequence's, else over per-row keys (in chunks of `own_row` bytes a row). Only what the
        branches read is passed in: torch.cond rejects operands that alias one another, and the
        step's index tables are views of one packed buffer (model_executor/step_pack.py)."""
        fmt = io.fmt.index

        def shared(q, w, valid, scope, vis_idx, cache):
            return (self._scores(q, w, scope, valid, ctx),)

        def own(q, w, valid, scope, vis_idx, cache):
            parts = [self._scores(q[a:b], w[a:b], fmt.decode(cache[vis_idx[a:b]], torch.float32), valid[a:b], ctx)
                     for a, b in row_chunks(q.shape[0], own_row)]
            return (parts[0] if len(parts) == 1 else torch.cat(parts),)
        # the branches return the scores and write nothing; the selection goes to io.topk_out after
        # the cond (LayerIO has slots so that Dynamo keeps that write: models/v4_common.py)
        return scope_branch(meta.in_scope[rows], shared, own,
                            (q, w, meta.vis_valid[rows], scope, meta.vis_idx[rows], io.index_keys), "indexer")[0]

    def _index_rows(self, scores, meta, io: LayerIO, rows: slice) -> tuple:
        """Top-k over some rows' scores: (selected entry columns [rows, k],) plus the candidate blocks
        at the candidate source layer (V4.1's candidate filter applied first at its consumers)."""
        cfg = self.cfg
        if cfg.is_v41:
            if self.candidate_consumer and io.candidates is not None:
                mask = candidate_entry_mask(io.candidates[rows], scores.shape[1], cfg.candidate_block_size)
                scores = scores.masked_fill(~mask, float("-inf"))
            if self.candidate_source:
                cand = candidate_blocks(scores, meta.n_vis[rows], cfg.candidate_block_size, cfg.candidate_topk_blocks)
                return stable_topk(scores, cfg.index_topk), cand
        return (stable_topk(scores, cfg.index_topk),)

    def _attend_rows(self, q, ring, new, swa_idx, entries, valid, io: LayerIO, ctx: StepContext) -> torch.Tensor:
        """Sink attention of some rows over their window records (rows of cat([ring, new])) and their
        selected entries' decoded records ([rows, k, d], None for a window-only layer)."""
        keys = io.fmt.swa.decode(concat_rows(ring, new, swa_idx), q.dtype)
        if entries is not None:
            keys = torch.cat([keys, entries], dim=1)
        return ctx.k.sink_attention(q, keys.to(q.dtype), valid, self.attn_sink, self.cfg.head_dim ** -0.5)

    def forward(self, h: torch.Tensor, ctx: StepContext, io: LayerIO) -> torch.Tensor:
        return self.attend(h, *self.project(h, ctx, io), ctx, io)

    def project(self, h: torch.Tensor, ctx: StepContext, io: LayerIO):
        """The projections: query latent cq, RoPE'd queries q [T, heads, d] and key/value kv [T, d],
        and this step's compressed entries and index keys written to their caches. A stage of its
        own: neuronx-cc crashed on multi-row graphs merging it with the indexer (docs/neuron.md §4 B4)."""
        cfg = self.cfg
        t = h.shape[0]
        nh, d = self.n_heads, cfg.head_dim
        cq = ctx.k.rms_norm(linear_mm(h, self.wq_a, ctx.k), self.q_norm.weight, cfg.rms_norm_eps)
        q = linear_mm(cq, self.wq_b, ctx.k).view(t, nh, d)
        if not cfg.is_v41:
            q = ctx.k.rms_norm(q, None, cfg.rms_norm_eps)
        cos, sin = ctx.rope(self.rope_kind)
        q = ctx.k.rope(q, cos[:, None], sin[:, None])
        kv = ctx.k.rope(ctx.k.rms_norm(linear_mm(h, self.wkv, ctx.k), self.kv_norm.weight, cfg.rms_norm_eps),
                        cos, sin)
        if self.ratio > 0 and self.comp_key is not None:
            h_src = io.shared_hidden if self.uses_shared_hidden else h
            self._compress(h_src, ctx, io)
        return cq, q, kv

    def attend(self, h: torch.Tensor, cq: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
               io: LayerIO) -> torch.Tensor:
        """Indexer, sparse attention over the window and the selected entries, window write, output
        projection (summed over the lane)."""
        cfg, step = self.cfg, ctx.step
        t = h.shape[0]
        d = cfg.head_dim
        cos, sin = ctx.rope(self.rope_kind)
        ring = io.swa
        # this step's rows go through the record format too, so they read back as later steps see them;
        # each row's window records are rows of cat([ring, new]), gathered without building it when
        # they are few (layers/concat_rows.py)
        new = io.fmt.swa.encode(kv)
        window = concat_sources(ring, new, step.swa_idx.numel())   # one source for the snapshot and every row chunk
        if io.swa_snap is not None and step.prefix is not None:
            prefix_state.snapshot(io.swa_snap, step.prefix.swa, *window)
        valid = step.swa_valid
        meta = cols = scope = None
        scopes = _eager_seq_scopes(ctx)
        if self.ratio > 0:
            meta = step.comp[self.src_comp_key]
            sel = self._select(h, cq, ctx, meta, io)
            cols = sel.clamp(min=0)
            valid = torch.cat([valid, sel >= 0], dim=1)
            if meta.scope_idx is not None and scopes is None:
                # a prompt chunk: the records its last row sees, gathered and decoded once; each row
                # takes its selected columns of them (docs/model.md §3.3)
                scope = io.fmt.entries.decode(io.entries[meta.scope_idx], q.dtype)
        records_of = (None, None)   # (last row, its scope's records): an eager step's ranges come in row order

        def attend(a, b, last=None):
            nonlocal records_of
            entries = None
            if cols is not None:
                c = cols[a:b]
                rows = meta.vis_idx[a:b].gather(1, c) if c.numel() else c   # pool rows of the selected entries
                if last is not None:   # an eager step's prompt chunk: its own scope, gathered once
                    if records_of[0] != last:
                        records_of = (last, io.fmt.entries.decode(io.entries[meta.vis_idx[last]], q.dtype))
                    entries = records_of[1][c]
                elif scope is None:   # decode: gathered per row from the cache
                    entries = io.fmt.entries.decode(io.entries[rows], q.dtype)
                else:
                    fmt = io.fmt.entries
                    entries = scope_branch(meta.in_scope[a:b], lambda scope, c, rows, cache: (scope[c],),
                                           lambda scope, c, rows, cache: (fmt.decode(cache[rows], q.dtype),),
                                           (scope, c, rows, io.entries), "attention")[0]
            return self._attend_rows(q[a:b], *window, step.swa_idx[a:b], entries, valid[a:b], io, ctx)
        # a row's gathered records [K, d], read in fp32 by the attention (row_chunks.py)
        per_row = valid.shape[1] * d * 6
        if scopes is not None and cols is not None:
            parts = [attend(a, b, last) for a, b, last in scope_chunks(t, per_row, per_row, scopes)]
        else:
            parts = [attend(a, b) for a, b in row_chunks(t, per_row)]
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        if step.swa_write_dst.numel():
            ring[step.swa_write_dst] = io.fmt.swa.encode(kv[step.swa_write_src])
        o = ctx.k.rope(o, cos[:, None], sin[:, None], inverse=True)
        z = grouped_mm(o.reshape(t, self.n_groups, -1), self.wo_a, ctx.k)   # [T, G, o_lora_rank]
        # a lane rank's heads give a partial output; wo_a and wo_b are linear in the heads, so the
        # lane's sum is the full output (identity without a lane)
        return comm.all_reduce(linear_mm(z.reshape(t, -1), self.wo_b, ctx.k), self.lane)
