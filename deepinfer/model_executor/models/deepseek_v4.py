"""The DeepSeek V4 / V4.1 decoder (model.md §3), one definition for both model types.

Module and parameter names equal the canonical checkpoint names (model.md §2.2), so
`model.state_dict()` is the loader's list of expected tensors.

`forward(step, cache)` takes one step's flat batch (`StepInputs`, host-built metadata) and the
per-layer caches (`ModelCache`); prefill, chunked prefill and decode all go through it.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.model_executor.forward_meta import StepInputs
from deepinfer.model_executor.layers.compressor import gather_overlap_slots
from deepinfer.model_executor.layers.engram import engram_embed
from deepinfer.model_executor.layers.indexer import candidate_blocks, candidate_entry_mask, stable_topk
from deepinfer.model_executor.layers.kernels import KernelTable
from deepinfer.model_executor.layers.moe import route
from deepinfer.model_executor.layers.rope import RotaryEmbedding


def _linear(i: int, o: int, dtype) -> nn.Linear:
    return nn.Linear(i, o, bias=False, dtype=dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))


def _f32(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


@dataclass
class ModelCache:
    """Storage the forward reads and writes; allocated by worker/cache_engine.py."""
    swa: dict = field(default_factory=dict)         # layer -> [slots * W, d]
    comp_state: dict = field(default_factory=dict)  # (layer, "main"|"index") -> [slots * ring, 2 * width]
    entries: dict = field(default_factory=dict)     # kv-source layer -> [blocks * epb, d]
    index_keys: dict = field(default_factory=dict)  # index-K source layer -> [blocks * epb, index_head_dim]
    formats: "CacheFormats" = None                 # encode/decode of swa, entries and index records


@dataclass(frozen=True)
class CacheFormats:
    swa: object
    entries: object
    index: object


class _StepContext:
    """Per-forward values shared across layers: RoPE tables, top-k reuse, YOCO shared hidden.

    Everything position- or layer-dependent is computed here, eagerly, before the layer loop (RoPE
    tables, Engram rows), so layer code only reads it: compiled layer regions then see the same
    Python state for every layer of a kind (neuron.md F1)."""

    def __init__(self, model: "DeepseekV4Model", step: StepInputs, cache: ModelCache):
        self.step = step
        self.cache = cache
        self.model = model
        self.k = model.kernels
        self._rope = {kind: rot.cos_sin(step.positions) for kind, rot in model.rotary.items()}
        self._entry_rope = {key: model.rotary["compress"].cos_sin(meta.entry_pos) for key, meta in step.comp.items()}
        self.engram_rows: dict[int, torch.Tensor] = {}
        spec = model.engram_spec
        if spec is not None and step.ngram_ids is not None:
            from deepinfer.model_executor.layers.engram_hash import engram_indices
            # exact int64 hashing stays on the host side of the step (neuron.md A4/A5)
            self.engram_rows = {lid: engram_indices(spec, lid, step.ngram_ids) for lid in spec.layer_ids}
        self.topk: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.shared_hidden: torch.Tensor | None = None
        self.targets: dict[int, torch.Tensor] = {}

    def rope(self, kind: str):
        """cos/sin of the step's token positions for "main" or "compress"."""
        return self._rope[kind]

    def entry_rope(self, comp_key):
        """cos/sin (compress) of the positions of the entries a compressor writes this step."""
        return self._entry_rope[comp_key]


@dataclass
class LayerIO:
    """One layer's cache tensors and cross-layer inputs, resolved by the eager layer loop
    (`DecoderLayer.layer_io`), so layer code never indexes anything by its layer id and one compiled
    region serves every layer of a kind. Values a layer hands to later layers go to the `*_out`
    fields and are stored back by `DecoderLayer.collect`."""
    swa: torch.Tensor                           # SWA ring (written)
    fmt: "CacheFormats"                         # record formats of the stores (plain or compact)
    state: torch.Tensor | None = None           # own compressor state ring (read + written)
    index_state: torch.Tensor | None = None     # own V4 indexer-compressor state ring
    entries: torch.Tensor | None = None         # entry pool attention reads (written by its owner)
    index_keys: torch.Tensor | None = None      # index-key pool the indexer reads (written by its owner)
    topk: torch.Tensor | None = None            # selection reused from the index source layer
    candidates: torch.Tensor | None = None      # V4.1 candidate blocks of the candidate source layer
    shared_hidden: torch.Tensor | None = None   # V4.1 YOCO hidden of n_prefill_layer
    engram_rows: torch.Tensor | None = None     # Engram table rows of this layer
    topk_out: torch.Tensor | None = None
    candidates_out: torch.Tensor | None = None
    shared_hidden_out: torch.Tensor | None = None
    target_out: torch.Tensor | None = None


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


class Compressor(nn.Module):
    def __init__(self, dim: int, width: int, ratio: int, overlap: bool, gated: bool, ape: bool, dtype,
                 out_norm: int):
        super().__init__()
        mult = 2 if overlap else 1
        self.width, self.ratio, self.overlap = width, ratio, overlap
        self.wkv = _linear(dim, mult * width, dtype)
        self.wgate = _linear(dim, mult * width, dtype) if gated else None
        self.ape = nn.Parameter(torch.zeros(ratio, mult * width, dtype=dtype)) if ape else None
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
        self.wq_b = _linear(cfg.q_lora_rank, n_i * d_i, dtype)
        self.weights_proj = _linear(cfg.hidden_size, n_i, dtype)
        if cfg.is_v41:
            if cfg.index_k_source_map[layer] == layer:
                self.wk = _linear(cfg.head_dim, d_i, dtype)
                self.k_norm = Norm(d_i, dtype)
        else:
            m = cfg.compress_ratios[layer]
            self.compressor = Compressor(cfg.hidden_size, d_i, m, True, True, True, dtype, d_i)


class Attention(nn.Module):
    def __init__(self, cfg, layer: int, dtype, draft: bool = False):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, h = cfg.head_dim, cfg.num_heads
        self.wq_a = _linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = Norm(cfg.q_lora_rank, dtype)
        self.wq_b = _linear(cfg.q_lora_rank, h * d, dtype)
        self.wkv = _linear(cfg.hidden_size, d, dtype)
        self.kv_norm = Norm(d, dtype)
        self.wo_a = _linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = _f32(h)
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
    def _pool(self, comp: "Compressor", rows: torch.Tensor, state: torch.Tensor, meta, ctx: _StepContext,
              out_dtype: torch.dtype) -> torch.Tensor | None:
        """Pool the windows that complete this step from cat([state ring, this step's rows]) into
        normalised pre-RoPE entries (None when none completes), and save the rows later windows need."""
        latent = None
        if meta.entry_dst.numel():
            c, z = gather_overlap_slots(torch.cat([state, rows.to(state.dtype)]), meta.src_idx, comp.width,
                                        comp.overlap)
            pooled = ctx.k.compress_pool(c, z, meta.src_valid).to(out_dtype)
            latent = ctx.k.rms_norm(pooled, comp.norm.weight, self.cfg.rms_norm_eps)
        if meta.state_dst.numel():
            state[meta.state_dst] = rows[meta.state_src].to(state.dtype)
        return latent

    def _compress(self, h_src: torch.Tensor, ctx: _StepContext, io: LayerIO):
        cfg, step = self.cfg, ctx.step
        meta = step.comp[self.comp_key]
        rows = self.compressor.project(h_src, step.positions, fp32_out=cfg.is_v41)
        latent = self._pool(self.compressor, rows, io.state, meta, ctx, h_src.dtype)
        cos, sin = ctx.entry_rope(self.comp_key)
        if latent is not None:
            io.entries[meta.entry_dst] = io.fmt.entries.encode(ctx.k.rope(latent, cos, sin))
        if not cfg.is_v41 and self.is_index_source:
            # V4 index keys: the indexer's own overlapping compressor over the same windows
            icomp = self.indexer.compressor
            irows = icomp.project(h_src, step.positions, fp32_out=False)
            keys = self._pool(icomp, irows, io.index_state, meta, ctx, h_src.dtype)
        elif cfg.is_v41 and latent is not None and hasattr(self, "indexer") and hasattr(self.indexer, "wk"):
            # V4.1 index keys: projected from the pre-RoPE latent
            keys = ctx.k.rms_norm(latent @ self.indexer.wk.weight.t(), self.indexer.k_norm.weight,
                                  cfg.rms_norm_eps)
        else:
            keys = None
        if keys is not None:
            io.index_keys[meta.entry_dst] = io.fmt.index.encode(ctx.k.rope(keys, cos, sin))

    # -- sparse selection ----------------------------------------------------------------------
    def _select(self, h: torch.Tensor, cq: torch.Tensor, ctx: _StepContext, meta, io: LayerIO) -> torch.Tensor:
        """Entry columns (w) selected per token, [T, k] with -1 for none."""
        cfg = self.cfg
        if not cfg.is_v41 and self.kind == "hca":
            wcol = torch.arange(meta.vis_idx.shape[1], device=meta.vis_idx.device)[None, :].expand_as(meta.vis_idx)
            return torch.where(meta.vis_valid, wcol, torch.full_like(wcol, -1))
        if not self.is_index_source:
            return io.topk
        t = h.shape[0]
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        q = (cq @ self.indexer.wq_b.weight.t()).view(t, n_i, d_i)
        cos, sin = ctx.rope("compress")
        q = ctx.k.rope(q, cos[:, None], sin[:, None])
        w = (h @ self.indexer.weights_proj.weight.t()).float()
        keys = io.fmt.index.decode(io.index_keys[meta.vis_idx], torch.float32)
        if cfg.is_v41:
            scores = ctx.k.index_scores(q, keys, w, meta.vis_valid)
            if self.candidate_consumer and io.candidates is not None:
                mask = candidate_entry_mask(io.candidates, scores.shape[1], cfg.candidate_block_size)
                scores = scores.masked_fill(~mask, float("-inf"))
            if self.candidate_source:
                io.candidates_out = candidate_blocks(scores, meta.n_vis, cfg.candidate_block_size,
                                                     cfg.candidate_topk_blocks)
        else:
            scores = ctx.k.index_scores(q, keys, w * n_i ** -0.5, meta.vis_valid, key_scale=d_i ** -0.5)
        sel = stable_topk(scores, cfg.index_topk)
        io.topk_out = sel
        return sel

    def forward(self, h: torch.Tensor, ctx: _StepContext, io: LayerIO) -> torch.Tensor:
        cfg, step = self.cfg, ctx.step
        t = h.shape[0]
        nh, d = cfg.num_heads, cfg.head_dim
        cq = ctx.k.rms_norm(h @ self.wq_a.weight.t(), self.q_norm.weight, cfg.rms_norm_eps)
        q = (cq @ self.wq_b.weight.t()).view(t, nh, d)
        if not cfg.is_v41:
            q = ctx.k.rms_norm(q, None, cfg.rms_norm_eps)
        cos, sin = ctx.rope(self.rope_kind)
        q = ctx.k.rope(q, cos[:, None], sin[:, None])
        kv = ctx.k.rope(ctx.k.rms_norm(h @ self.wkv.weight.t(), self.kv_norm.weight, cfg.rms_norm_eps), cos, sin)

        ring = io.swa
        # this step's rows go through the record format too, so they read back as later steps see them
        keys = io.fmt.swa.decode(torch.cat([ring, io.fmt.swa.encode(kv)])[step.swa_idx], q.dtype)
        valid = step.swa_valid
        if self.ratio > 0:
            if self.comp_key is not None:
                h_src = io.shared_hidden if self.uses_shared_hidden else h
                self._compress(h_src, ctx, io)
            meta = step.comp[self.src_comp_key]
            sel = self._select(h, cq, ctx, meta, io)
            sel_ok = sel >= 0
            rows = meta.vis_idx.gather(1, sel.clamp(min=0)) if sel.numel() else sel.clamp(min=0)
            comp_keys = io.fmt.entries.decode(io.entries[rows], q.dtype)
            keys = torch.cat([keys, comp_keys], dim=1)
            valid = torch.cat([valid, sel_ok], dim=1)
        o = ctx.k.sink_attention(q, keys.to(q.dtype), valid, self.attn_sink, d ** -0.5)
        if step.swa_write_dst.numel():
            ring[step.swa_write_dst] = io.fmt.swa.encode(kv[step.swa_write_src])
        o = ctx.k.rope(o, cos[:, None], sin[:, None], inverse=True)
        g = cfg.o_groups
        wo_a = self.wo_a.weight.view(g, cfg.o_lora_rank, -1)
        z = torch.einsum("tgi,goi->tgo", o.reshape(t, g, -1), wo_a)
        return z.reshape(t, -1) @ self.wo_b.weight.t()


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype):
        super().__init__()
        self.w1 = _linear(dim, inter, dtype)
        self.w2 = _linear(inter, dim, dtype)
        self.w3 = _linear(dim, inter, dtype)


class Gate(nn.Module):
    def __init__(self, cfg, n_experts: int, topk: int, hashed: bool, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, cfg.hidden_size, dtype=dtype))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, topk, dtype=torch.long))
        else:
            self.bias = _f32(n_experts)
        if cfg.is_v41:
            self.bias_vl = _f32(n_experts)


class MoE(nn.Module):
    def __init__(self, cfg, hashed: bool, dtype, n_experts: int | None = None, topk: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.n_experts = n_experts or cfg.n_routed_experts
        self.topk = topk or cfg.n_experts_per_tok
        self.hashed = hashed
        self.gate = Gate(cfg, self.n_experts, self.topk, hashed, dtype)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_inter_size, dtype)
                                     for _ in range(self.n_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_inter_size * max(1, cfg.n_shared_experts), dtype)
        # non-persistent buffers: not checkpoint tensors, but moved by model.to(device) like the weights
        self.register_buffer("_w13", None, persistent=False)
        self.register_buffer("_w2", None, persistent=False)

    def pack(self):
        """Stack expert weights once after loading (the per-expert modules keep the checkpoint names)."""
        # fp32: stored transposed (see post_load)
        w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])
        w2 = torch.stack([e.w2.weight for e in self.experts])
        if w13.dtype == torch.float32:
            w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
            w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        self._w13, self._w2 = w13, w2

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, k, static_shapes: bool = False) -> torch.Tensor:
        if self._w13 is None:
            self.pack()
        hashed = self.gate.tid2eid[token_ids] if self.hashed else None
        bias = None if self.hashed else self.gate.bias
        idx, w = route(x, self.gate.weight, bias, self.topk, self.cfg.routed_scaling_factor, hashed)
        experts = k.moe_experts_static if static_shapes else k.moe_experts
        y = experts(x, idx, w, self._w13, self._w2, self.cfg.swiglu_limit)
        s = self.shared_experts
        return y + k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, self.cfg.swiglu_limit)


class Engram(nn.Module):
    def __init__(self, cfg, layer: int, rows: int, dtype, spec):
        super().__init__()
        self.cfg, self.layer, self.spec = cfg, layer, spec
        n_hc, dim = cfg.hc_mult, cfg.hidden_size
        n_embed = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.embed = nn.Module()  # the table is named `engram.embed.weight` in the checkpoint
        self.embed.weight = nn.Parameter(torch.zeros(rows, cfg.engram_head_dim, dtype=dtype))
        self.q_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.wkv = _linear(n_embed, (n_hc + 1) * dim, dtype)

    def forward(self, x: torch.Tensor, ctx: _StepContext, rows: torch.Tensor) -> torch.Tensor:
        e = engram_embed(self.embed.weight, rows).to(x.dtype)
        kv = e @ self.wkv.weight.t()
        return ctx.k.engram_gate(x, kv, self.q_weight, self.k_weight, self.cfg.rms_norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, dtype, draft: bool = False, engram_spec=None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        dim, n = cfg.hidden_size, cfg.hc_mult
        mix = (2 + n) * n
        self.attn_norm = Norm(dim, dtype)
        self.ffn_norm = Norm(dim, dtype)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _f32(mix, n * dim), _f32(mix), _f32(3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _f32(mix, n * dim), _f32(mix), _f32(3)
        self.attn = Attention(cfg, layer, dtype, draft=draft)
        hashed = (not draft) and bool(cfg.hash_moe[layer])
        if draft:
            self.ffn = MoE(cfg, False, dtype, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        else:
            self.ffn = MoE(cfg, hashed, dtype)
        if engram_spec is not None and layer in engram_spec.layers:
            self.engram = Engram(cfg, layer, engram_spec.layer(layer).num_rows, dtype, engram_spec)
        self.is_target = (not draft) and cfg.is_v41 and layer in set(cfg.dspark_target_layer_ids or [])
        self.is_shared_hidden_source = (not draft) and cfg.is_v41 and layer == cfg.n_prefill_layer

    def layer_io(self, ctx: _StepContext) -> LayerIO:
        """This layer's caches and cross-layer inputs (eager: the only place that uses the layer id)."""
        cfg, cache, i = self.cfg, ctx.cache, self.layer
        attn = self.attn
        io = LayerIO(swa=cache.swa[i], fmt=cache.formats, state=cache.comp_state.get((i, "main")),
                     index_state=cache.comp_state.get((i, "index")))
        if attn.ratio > 0:
            io.entries = cache.entries[cfg.kv_source_map[i] if cfg.is_v41 else i]
            if attn.is_index_source:
                io.index_keys = cache.index_keys[cfg.index_k_source_map[i] if cfg.is_v41 else i]
            elif cfg.is_v41:
                io.topk = ctx.topk[cfg.index_source_map[i]]
            if attn.candidate_consumer:
                io.candidates = ctx.candidates
            if attn.uses_shared_hidden and attn.comp_key is not None:
                io.shared_hidden = ctx.shared_hidden
        if hasattr(self, "engram"):
            io.engram_rows = ctx.engram_rows[i]
        return io

    def collect(self, io: LayerIO, ctx: _StepContext) -> None:
        """Store what this layer produced for later layers (eager)."""
        if io.topk_out is not None:
            ctx.topk[self.layer] = io.topk_out
        if io.candidates_out is not None:
            ctx.candidates = io.candidates_out
        if io.shared_hidden_out is not None:
            ctx.shared_hidden = io.shared_hidden_out
        if io.target_out is not None:
            ctx.targets[self.layer] = io.target_out

    def forward(self, x: torch.Tensor, prev_pre: torch.Tensor | None, ctx: _StepContext, io: LayerIO):
        x, pre = self.attn_half(x, prev_pre, ctx, io)
        return self.ffn_half(x, pre, ctx)

    def attn_half(self, x: torch.Tensor, prev_pre: torch.Tensor | None, ctx: _StepContext, io: LayerIO):
        """Engram, HC mix and the attention block; returns the trunk and the attention pre weights."""
        cfg, k = self.cfg, ctx.k
        eps, he, it = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        if hasattr(self, "engram"):
            x = self.engram(x, ctx, io.engram_rows)
        if self.is_target:
            io.target_out = x.float().mean(dim=1).to(x.dtype)
        pre, post, comb = k.hc_mixes(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, eps, he, it)
        u = k.hc_pre(x, prev_pre if cfg.hc_shifted else pre)
        h = ctx.k.rms_norm(u, self.attn_norm.weight, eps)
        if self.is_shared_hidden_source:
            io.shared_hidden_out = h
        x = k.hc_post(x, self.attn(h, ctx, io), post, comb)
        return x, pre

    def ffn_half(self, x: torch.Tensor, pre: torch.Tensor, ctx: _StepContext):
        """HC mix and the MoE block; returns the trunk and the FFN pre weights (next layer's shift)."""
        cfg, k = self.cfg, ctx.k
        eps, he, it = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        pre2, post2, comb2 = k.hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, eps, he, it)
        u = k.hc_pre(x, pre if cfg.hc_shifted else pre2)
        h = ctx.k.rms_norm(u, self.ffn_norm.weight, eps)
        x = k.hc_post(x, self.ffn(h, ctx.step.input_ids, k, ctx.step.static_shapes), post2, comb2)
        return x, pre2


class DraftHeads(nn.Module):
    """DSpark extras of an `mtp.{i}` block (model.md §2.2, §3.8); drafting itself is a later issue."""

    def __init__(self, cfg, dtype, with_main: bool, with_heads: bool):
        super().__init__()
        dim, r_m, v = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
        if with_main:
            self.main_proj = _linear(dim * len(cfg.dspark_target_layer_ids), dim, dtype)
            self.main_norm = Norm(dim, dtype)
        if with_heads:
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(v, r_m, dtype=dtype)
            self.markov_head.head = _linear(r_m, v, dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = _linear(dim + r_m, 1, dtype)
            self.norm = Norm(dim, dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype = torch.float32, draft_layout: dict | None = None, platform=None):
        super().__init__()
        self.cfg = cfg
        self.kernels = KernelTable(platform)
        self.dtype = dtype
        dim = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, dim, dtype=dtype)
        self.engram_spec = make_engram_spec(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, engram_spec=self.engram_spec) for i in range(cfg.num_layers))
        self.norm = Norm(dim, dtype)
        self.head = _linear(dim, cfg.vocab_size, dtype)
        if not cfg.hc_shifted:
            self.hc_head_fn = _f32(cfg.hc_mult, cfg.hc_mult * dim)
            self.hc_head_base = _f32(cfg.hc_mult)
            self.hc_head_scale = _f32(1)
        self.target_layers = set(cfg.dspark_target_layer_ids or []) if cfg.is_v41 else set()
        nextn = cfg.num_nextn_predict_layers if cfg.is_v41 else 0
        if nextn:
            layout = draft_layout or default_draft_layout(nextn)
            self.mtp = nn.ModuleList()
            for i in range(nextn):
                blk = DecoderLayer(cfg, cfg.num_layers + i, dtype, draft=True)
                extras = DraftHeads(cfg, dtype, *layout[i])
                for name, mod in extras.named_children():
                    blk.add_module(name, mod)
                self.mtp.append(blk)
        yarn = cfg.rope_scaling
        self.rotary = {
            "main": RotaryEmbedding(cfg.rope_dim, cfg.rope_theta),
            "compress": RotaryEmbedding(cfg.rope_dim, cfg.compress_rope_theta, yarn),
        }

    def post_load(self):
        # fp32 Linear weights keep their [out, in] shape but live in [in, out] memory order, so every
        # `x @ w.t()` multiplies by a contiguous matrix (MKL sgemm: ~1.3-2x faster for these shapes,
        # the LM head 23 -> 12 ms at batch 1). bf16 GEMMs measured the opposite (10x slower), so bf16
        # weights stay row-major. wo_a is viewed per group, so it stays row-major too.
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith(("wo_a", "head")) and mod.weight.dtype == torch.float32:
                mod.weight.data = mod.weight.data.t().contiguous().t()
        # the fp32 LM head keeps a transposed copy (see compute_logits); the parameter stays as loaded
        if self.head.weight.dtype == torch.float32:
            self.register_buffer("_head_t", self.head.weight.detach().t().contiguous(), persistent=False)
        for layer in self.layers:
            layer.ffn.pack()
        if hasattr(self, "mtp"):
            for blk in self.mtp:
                blk.ffn.pack()

    @torch.inference_mode()
    def forward(self, step: StepInputs, cache: ModelCache, run_layer=None) -> torch.Tensor:
        """Returns fp32 logits [len(step.logits_indices), vocab].

        run_layer(layer, x, prev_pre, ctx, io) -> (x, pre) replaces the plain layer call; graph
        runners pass compiled layer regions here (the top level stays eager)."""
        return self.compute_logits(self.hidden_states(step, cache, run_layer))

    def hidden_states(self, step: StepInputs, cache: ModelCache, run_layer=None) -> torch.Tensor:
        cfg = self.cfg
        ctx = _StepContext(self, step, cache)
        e = self.embed.weight[step.input_ids]
        x = e[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        prev_pre = None
        if cfg.hc_shifted:
            prev_pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
            prev_pre[:, 0] = 1.0
        for layer in self.layers:
            io = layer.layer_io(ctx)
            if run_layer is None:
                x, prev_pre = layer(x, prev_pre, ctx, io)
            else:
                x, prev_pre = run_layer(layer, x, prev_pre, ctx, io)
            layer.collect(io, ctx)
        x = x[step.logits_indices]
        if cfg.hc_shifted:
            h = self.kernels.hc_pre(x, prev_pre[step.logits_indices])
        else:
            w = self.kernels.hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                cfg.rms_norm_eps, cfg.hc_eps)
            h = self.kernels.hc_pre(x, w)
        return self.kernels.rms_norm(h, self.norm.weight, cfg.rms_norm_eps)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        # fp32: against a contiguous [D, V] copy of the head (MKL sgemm ~1.3-2x faster than x @ W^T
        # here); bf16 is fastest as a plain x @ W^T on these CPUs.
        head_t = getattr(self, "_head_t", None)
        if head_t is None:
            return (h @ self.head.weight.t()).float()
        return (h @ head_t).float()


def default_draft_layout(nextn: int) -> list[tuple[bool, bool]]:
    """(has main_proj/main_norm, has markov/confidence/norm) per draft block: DI reads main_proj from
    mtp.0 and the heads from mtp.{nextn-1} (model.md §2.2, §8 item 5)."""
    return [(i == 0, i == nextn - 1) for i in range(nextn)]


def make_engram_spec(cfg):
    """Hash layout of the Engram layers (None without Engram); uses the shipped compressed vocabulary."""
    if not cfg.is_v41 or not cfg.engram_layer_ids:
        return None
    from deepinfer.model_executor.layers.engram_hash import EngramHashSpec
    return EngramHashSpec.from_config(cfg)
