"""The DeepSeek V4 / V4.1 decoder (docs/model.md §3), one definition for both model types.

Module and parameter names equal the canonical checkpoint names (docs/model.md §2.2), so
`model.state_dict()` is the loader's list of expected tensors.

`forward(step, cache)` takes one step's flat batch (`StepInputs`, host-built metadata) and the
per-layer caches (`ModelCache`); prefill, chunked prefill and decode all go through it.
This file holds the decoder layer and the model; attention lives in v4_attention.py, the MoE and
Engram in v4_ffn.py, the shared caches / step context / LayerIO in v4_common.py.
"""
import torch
from torch import nn

from deepinfer.distributed.groups import ParallelGroups
from deepinfer.model_executor.checkpoint_formats import FP8, stored_as
from deepinfer.model_executor.forward_meta import StepInputs
from deepinfer.model_executor.layers import engram_host
from deepinfer.model_executor.layers.head_gemm import head_logits, head_logits_argmax
from deepinfer.model_executor.layers.kernel_table import KernelTable
from deepinfer.model_executor import prefix_state
from deepinfer.model_executor.layers.rope import RotaryEmbedding
from deepinfer.model_executor.layers.vocab_parallel import VocabShard
from deepinfer.model_executor.models import dspark_draft
from deepinfer.model_executor.models.v4_attention import Attention
from deepinfer.model_executor.models.v4_common import (LayerIO, ModelCache, Norm, StepContext, f32_param, linear,
                                                        rope_tables)
from deepinfer.model_executor.models.v4_ffn import Engram, MoE
from deepinfer.model_executor.shard_plan import ShardPlan


def layer_facts(cfg, layer: int, draft: bool = False) -> dict:
    """A decoder layer's static facts outside its attention, from the config alone: the layer is
    built from them, and the Neuron compile plan reads them without building the model
    (platforms/neuron/compile_plan.py)."""
    return dict(hashed=(not draft) and bool(cfg.hash_moe[layer]),
                n_experts=cfg.dspark_n_routed_experts if draft else cfg.n_routed_experts,
                topk=cfg.dspark_num_experts_per_tok if draft else cfg.n_experts_per_tok,
                is_target=(not draft) and cfg.is_v41 and layer in set(cfg.dspark_target_layer_ids or []),
                is_shared_hidden_source=(not draft) and cfg.is_v41 and layer == cfg.n_prefill_layer)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, dtype, draft: bool = False, engram_spec=None, shard=None):
        """shard: (ShardPlan, ParallelGroups) of a rank of a split model, None for the whole model."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        dim, n = cfg.hidden_size, cfg.hc_mult
        mix = (2 + n) * n
        self.attn_norm = Norm(dim, dtype)
        self.ffn_norm = Norm(dim, dtype)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = f32_param(mix, n * dim), f32_param(mix), f32_param(3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = f32_param(mix, n * dim), f32_param(mix), f32_param(3)
        plan, groups = shard if shard is not None else (None, None)
        lanes = plan is not None and plan.layout.attn_tp > 1
        self.attn = Attention(cfg, layer, dtype, draft=draft, heads=plan.heads if lanes else None,
                              lane=groups.lane if lanes else None)
        facts = layer_facts(cfg, layer, draft)
        n_experts = facts["n_experts"]
        ep = {}
        if plan is not None and plan.layout.ep > 1:
            ep = dict(experts=plan.experts(n_experts), ep=groups.ep,
                      tokens_replicated=plan.layout.tokens_replicated_in_ep,
                      shared_units=plan.shared_units(cfg.moe_inter_size * max(1, cfg.n_shared_experts)),
                      shared_weight=plan.shared_split / plan.layout.ep)
        self.ffn = MoE(cfg, facts["hashed"], dtype, n_experts, facts["topk"], **ep)
        if engram_spec is not None and layer in engram_spec.layers:
            self.engram = Engram(cfg, layer, engram_spec.layer(layer).num_rows, dtype, engram_spec)
        self.is_target = facts["is_target"]
        self.is_shared_hidden_source = facts["is_shared_hidden_source"]

    def layer_io(self, ctx: StepContext) -> LayerIO:
        """This layer's caches and cross-layer inputs (eager: the only place that uses the layer id)."""
        cfg, cache, i = self.cfg, ctx.cache, self.layer
        attn = self.attn
        io = LayerIO(swa=cache.swa[i], fmt=cache.formats, state=cache.comp_state.get((i, "main")),
                     index_state=cache.comp_state.get((i, "index")), swa_snap=cache.swa_snap.get(i),
                     state_snap=cache.state_snap.get((i, "main")),
                     index_state_snap=cache.state_snap.get((i, "index")))
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
            if i not in ctx.engram_rows:
                raise ValueError(f"layer {i}: an Engram layer needs the step's n-gram ids or its gathered rows "
                                 f"(a CacheLayout built with the model's engram_spec)")
            io.engram_rows = ctx.engram_rows[i]
        return io

    def collect(self, io: LayerIO, ctx: StepContext) -> None:
        """Store what this layer produced for later layers (eager)."""
        if io.topk_out is not None:
            ctx.topk[self.layer] = io.topk_out
        if io.candidates_out is not None:
            ctx.candidates = io.candidates_out
        if io.shared_hidden_out is not None:
            ctx.shared_hidden = io.shared_hidden_out
        if io.target_out is not None:
            ctx.targets[self.layer] = io.target_out

    def forward(self, x: torch.Tensor, prev_pre: torch.Tensor | None, ctx: StepContext, io: LayerIO):
        x, pre = self.attn_half(x, prev_pre, ctx, io)
        return self.ffn_half(x, pre, ctx)

    def attn_half(self, x: torch.Tensor, prev_pre: torch.Tensor | None, ctx: StepContext, io: LayerIO):
        """Engram, HC mix and the attention block; returns the trunk and the attention pre weights."""
        return self.attn_out(*self.attn_in(x, prev_pre, ctx, io), ctx, io)

    def attn_in(self, x: torch.Tensor, prev_pre: torch.Tensor | None, ctx: StepContext, io: LayerIO):
        """Engram, HC mix, norm and the attention projections (`Attention.project`): what `attn_out`
        takes, as a tuple of tensors (a region boundary, docs/neuron.md §5.2)."""
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
        cq, q, kv = self.attn.project(h, ctx, io)
        return x, pre, post, comb, h, cq, q, kv

    def attn_out(self, x, pre, post, comb, h, cq, q, kv, ctx: StepContext, io: LayerIO):
        """Indexer, attention and output projection (`Attention.attend`), HC post; returns the trunk
        and the attention pre weights."""
        x = ctx.k.hc_post(x, self.attn.attend(h, cq, q, kv, ctx, io), post, comb)
        return x, pre

    def ffn_half(self, x: torch.Tensor, pre: torch.Tensor, ctx: StepContext):
        """HC mix and the MoE block; returns the trunk and the FFN pre weights (next layer's shift)."""
        cfg, k = self.cfg, ctx.k
        eps, he, it = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        pre2, post2, comb2 = k.hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, eps, he, it)
        u = k.hc_pre(x, pre if cfg.hc_shifted else pre2)
        h = ctx.k.rms_norm(u, self.ffn_norm.weight, eps)
        y = self.ffn(h, ctx.step.input_ids, k, ctx.step.static_shapes, ctx.step.token_valid)
        x = k.hc_post(x, y, post2, comb2)
        return x, pre2


class DraftHeads(nn.Module):
    """DSpark extras of an `mtp.{i}` block (docs/model.md §2.2, §3.8); the drafting forward is models/dspark_draft.py."""

    def __init__(self, cfg, dtype, with_main: bool, with_heads: bool):
        super().__init__()
        dim, r_m, v = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
        if with_main:
            self.main_proj = stored_as(FP8, linear(dim * len(cfg.dspark_target_layer_ids), dim, dtype))
            self.main_norm = Norm(dim, dtype)
        if with_heads:
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(v, r_m, dtype=dtype)
            self.markov_head.head = linear(r_m, v, dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = linear(dim + r_m, 1, dtype)
            self.norm = Norm(dim, dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype = torch.float32, draft_layout: dict | None = None, platform=None,
                 parallel: ParallelGroups | None = None):
        """parallel: this rank's process groups when the model runs across ranks (attention heads split
        in lanes, routed experts over the EP group; model_executor/shard_plan.py); None: one rank holds
        everything. The rank's parameters are then only its slices, under the checkpoint's names."""
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        self.shard_plan = ShardPlan(cfg, parallel.layout) if parallel is not None else None
        shard = (self.shard_plan, parallel) if parallel is not None and self.shard_plan.sharded else None
        self.kernels = KernelTable(platform)
        self.dtype = dtype
        dim = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, dim, dtype=dtype)
        self.engram_spec = make_engram_spec(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, engram_spec=self.engram_spec, shard=shard) for i in range(cfg.num_layers))
        self.norm = Norm(dim, dtype)
        # cp > 1: this rank's rows of the head only (layers/vocab_parallel.py); compute_logits then
        # gives its vocabulary slice, which the runner gathers or samples from (worker/model_runner.py)
        self.vocab_shard = VocabShard.of(self.shard_plan, parallel)
        self.head = linear(dim, cfg.vocab_size if self.vocab_shard is None else self.vocab_shard.size, dtype)
        if not cfg.hc_shifted:
            self.hc_head_fn = f32_param(cfg.hc_mult, cfg.hc_mult * dim)
            self.hc_head_base = f32_param(cfg.hc_mult)
            self.hc_head_scale = f32_param(1)
        self.target_layers = set(cfg.dspark_target_layer_ids or []) if cfg.is_v41 else set()
        # the draft layers keep the checkpoint's names: `mtp.{i}`, num_nextn_predict_layers of them
        num_draft_layers = cfg.num_nextn_predict_layers if cfg.is_v41 else 0
        if num_draft_layers:
            layout = draft_layout or default_draft_layout(num_draft_layers)
            self.mtp = nn.ModuleList()
            for i in range(num_draft_layers):
                blk = DecoderLayer(cfg, cfg.num_layers + i, dtype, draft=True, shard=shard)
                extras = DraftHeads(cfg, dtype, *layout[i])
                for name, mod in extras.named_children():
                    blk.add_module(name, mod)
                self.mtp.append(blk)
        self.writes_draft_keys = False  # set by enable_drafting (speculative decoding)
        self.draft_vocab = None  # set by use_draft_vocab: the token ids drafts may take (models/draft_vocab.py)
        self.target_capture: list | None = None  # a list to append each forward's DSpark target features to
        yarn = cfg.rope_scaling
        self.rotary = {
            "main": RotaryEmbedding(cfg.rope_dim, cfg.rope_theta),
            "compress": RotaryEmbedding(cfg.rope_dim, cfg.compress_rope_theta, yarn),
        }

    def post_load(self):
        # fp32 Linear weights keep their [out, in] shape but live in [in, out] memory order, so every
        # `x @ w.t()` multiplies by a contiguous matrix, which MKL's sgemm runs faster at these shapes;
        # bf16 GEMMs run slower that way, so bf16 weights stay row-major (docs/benchmarks.md, "fp32
        # weights in [in, out] memory order"). wo_a is viewed per group, so it stays row-major too.
        # The LM head too: `h @ head.weight.t()` then multiplies by a contiguous [D, V] matrix, with no
        # second copy of the head.
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith("wo_a") and mod.weight.dtype == torch.float32:
                mod.weight.data = mod.weight.data.t().contiguous().t()
        for layer in self.layers:
            layer.ffn.pack()
        if hasattr(self, "mtp"):
            for blk in self.mtp:
                blk.ffn.pack()

    @torch.inference_mode()
    def forward(self, step: StepInputs, cache: ModelCache, run_layer=None) -> torch.Tensor:
        """Returns fp32 logits [len(step.logits_indices), vocab].

        run_layer(layer, x, prev_pre, ctx, io) -> (x, pre) replaces the plain layer call; graph
        runners pass compiled layer regions here and run `begin` / `finish` as regions of their own
        (worker/runners/neuron_regions.py)."""
        return self.finish(*self._decoded(step, cache, run_layer))

    @torch.inference_mode()
    def forward_argmax(self, step: StepInputs, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s logits and each row's argmax where the head computes it (finish_argmax): what
        the eager runner (worker/runners/eager.py) hands the sampler's greedy rows."""
        return self.finish_argmax(*self._decoded(step, cache))

    def hidden_states(self, step: StepInputs, cache: ModelCache, run_layer=None) -> torch.Tensor:
        state, ctx = self._decoded(step, cache, run_layer)
        return self.final_hidden(*state, ctx)

    def _decoded(self, step: StepInputs, cache: ModelCache, run_layer=None):
        """(the last layer's (x, prev_pre), the step's context): the entry and every decoder layer."""
        x, prev_pre, tables = self.begin(step, cache)
        ctx = StepContext(self, step, cache, tables)
        return self.run_layers(x, prev_pre, ctx, run_layer), ctx

    def begin(self, step: StepInputs, cache: ModelCache):
        """The step's entry: prefix-state restores, the embedding spread over the HC streams, the
        initial pre weights and the RoPE tables (`rope_tables`): (x, prev_pre, tables)."""
        cfg = self.cfg
        if step.prefix is not None:
            prefix_state.restore(step.prefix, cache)
        e = self.embed.weight[step.input_ids]
        x = e[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        prev_pre = None
        if cfg.hc_shifted:
            prev_pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
            prev_pre[:, 0] = 1.0
        return x, prev_pre, rope_tables(self, step)

    def run_layers(self, x, prev_pre, ctx: StepContext, run_layer=None):
        """The decoder layers (eager loop: LayerIO per layer), then the draft-distillation capture."""
        for layer in self.layers:
            io = layer.layer_io(ctx)
            if run_layer is None:
                x, prev_pre = layer(x, prev_pre, ctx, io)
            else:
                x, prev_pre = run_layer(layer, x, prev_pre, ctx, io)
            layer.collect(io, ctx)
        if self.target_capture is not None:  # draft distillation (examples/tools/distill_tiny_drafts.py)
            self.target_capture.append(dspark_draft.target_features(self, ctx))
        return x, prev_pre

    def finish(self, state, ctx: StepContext) -> torch.Tensor:
        """The step's exit, from the last layer's (x, prev_pre): the draft layers' main keys (when
        drafting), the logits rows' HC collapse and final norm, the LM head."""
        return self.compute_logits(self.final_hidden(*state, ctx))

    def finish_argmax(self, state, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`finish`'s logits and each row's argmax where the head computes it alongside (None
        elsewhere, and on a vocabulary-split head, whose rows hold a slice of the vocabulary)."""
        h = self.final_hidden(*state, ctx)
        if self.vocab_shard is not None:
            return self.compute_logits(h), None
        return head_logits_argmax(h, self.head.weight, getattr(self.head, "weight_bf16", None))

    def final_hidden(self, x, prev_pre, ctx: StepContext) -> torch.Tensor:
        cfg, step = self.cfg, ctx.step
        if self.writes_draft_keys:
            dspark_draft.write_main_keys(self, ctx)
        x = x[step.logits_indices]
        if cfg.hc_shifted:
            h = self.kernels.hc_pre(x, prev_pre[step.logits_indices])
        else:
            w = self.kernels.hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                cfg.rms_norm_eps, cfg.hc_eps)
            h = self.kernels.hc_pre(x, w)
        return self.kernels.rms_norm(h, self.norm.weight, cfg.rms_norm_eps)

    def host_inputs(self, step: StepInputs) -> StepInputs:
        """The host stage of a step, before its copy to the device: the Engram rows hashed and gathered
        from the host tables (layers/engram_host.py)."""
        return engram_host.gather_step_rows(self, step)

    def enable_drafting(self) -> None:
        """Every later main forward also writes the draft layers' main keys (docs/model.md §3.8)."""
        dspark_draft.check_draftable(self.cfg)
        self.writes_draft_keys = True

    def use_draft_vocab(self, token_ids: list[int]) -> None:
        """Let drafts take only `token_ids` (sorted, distinct): the draft heads then read only those rows
        of the LM head and the Markov head (models/draft_vocab.py); verification is unchanged."""
        from deepinfer.model_executor.models import draft_vocab
        dspark_draft.check_draftable(self.cfg)
        cols = draft_vocab.DraftColumns.build(token_ids, self.vocab_shard)
        markov = self.mtp[-1].markov_head.head
        head = draft_vocab.dense_rows(self.head, cols.local_rows, cols.local_real, self.dtype)
        self.draft_vocab = draft_vocab.DraftVocab(
            cols, head, draft_vocab.dense_rows(markov, cols.ids, cols.mask == 0, self.dtype))

    def draft_columns(self, base: torch.Tensor) -> torch.Tensor:
        """The draft block's base logits over every draft column, from this rank's compute: the whole
        vocabulary (a split head's slices gathered), or the draft vocabulary's columns (gathered the same
        way, pad columns -inf)."""
        full = self.full_logits(base)
        return full if self.draft_vocab is None else full + self.draft_vocab.mask

    @torch.inference_mode()
    def draft(self, step: StepInputs, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_pre, base logits) of a DSpark draft block step (models/dspark_draft.py); the base
        logits cover every draft column (`draft_columns`: the vocabulary, or the draft vocabulary's
        columns), the driver's draft heads add to them."""
        hidden, base = dspark_draft.draft_forward(self, step, cache)
        return hidden, self.draft_columns(base)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every token's logits [N, V] from this rank's compute_logits output (its vocabulary slice
        when the head is split over the CP group)."""
        return logits if self.vocab_shard is None else self.vocab_shard.gather_full(logits)

    def draft_heads(self, hidden: torch.Tensor, base: torch.Tensor,
                    prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, V], confidence) of one draft depth given the previous token (models/dspark_draft.py),
        for the host's sampler: over the whole vocabulary, -inf outside a draft vocabulary."""
        logits, conf = dspark_draft.draft_heads(self, hidden, base, prev_ids)
        if self.draft_vocab is not None:
            logits = self.draft_vocab.expand(logits, self.cfg.vocab_size)
        return logits, conf

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of this rank's head rows: [N, V], or [N, V / cp] of vocab_shard's tokens."""
        # the orientation is chosen by measurement in layers/head_gemm.py; weight_bf16: the platform's
        # bf16 copy of a bf16-valued fp32 head, when it keeps one (platforms/cpu.py)
        return head_logits(h, self.head.weight, getattr(self.head, "weight_bf16", None))

    def map_fp8_codes(self, convert) -> None:
        """Replace every packed e4m3 weight's (codes, exponents) by convert(codes, exponents): a platform's
        layout of the bytes its kernels read (Platform.fp8_weight_codes), applied once after loading."""
        from deepinfer.model_executor.layers.packed_weights import PackedFp8Linear, PackedFp8Table
        for mod in [*self.modules(), *engram_host.host_tables(self).values()]:
            if isinstance(mod, (PackedFp8Linear, PackedFp8Table)):
                mod.weight, mod.scale = convert(mod.weight, mod.scale)

    def use_weight_formats(self, formats: dict) -> int:
        """Keep the weights named in `formats` (canonical weight name -> WeightFormat) in their checkpoint
        formats: each becomes a packed module (layers/packed_weights.py) on the device its dense
        module was on (meta, before loading). Returns how many were replaced."""
        from deepinfer.model_executor.layers.packed_weights import PackedFp4Weight, PackedFp8Linear, PackedFp8Table
        replaced = 0
        for path, mod in [*self.named_modules(), *engram_host.host_tables(self).items()]:
            fmt = formats.get(f"{path}.weight")
            if fmt is None:
                continue
            device = mod.weight.device
            if fmt.kind == "fp8" and isinstance(mod, nn.Linear):
                new = PackedFp8Linear(mod.in_features, mod.out_features, fmt, device=device)
            elif fmt.kind == "fp4" and isinstance(mod, nn.Linear):
                new = PackedFp4Weight(mod.in_features, mod.out_features, fmt, device=device)
            elif fmt.kind == "fp8_table":
                new = PackedFp8Table(mod.weight.shape[0], mod.weight.shape[1], fmt, device=device)
            else:
                raise ValueError(f"{path}.weight: no packed form of a {type(mod).__name__} as {fmt}")
            parent, _, leaf = path.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, leaf, new)
            replaced += 1
        return replaced


def default_draft_layout(num_draft_layers: int) -> list[tuple[bool, bool]]:
    """(has main_proj/main_norm, has markov/confidence/norm) per draft block: upstream DeepInfer reads
    main_proj from mtp.0 and the heads from the last block (docs/model.md §2.2, §8 item 5)."""
    return [(i == 0, i == num_draft_layers - 1) for i in range(num_draft_layers)]


def make_engram_spec(cfg):
    """Hash layout of the Engram layers (None without Engram); uses the shipped compressed vocabulary."""
    if not cfg.is_v41 or not cfg.engram_layer_ids:
        return None
    from deepinfer.model_executor.layers.engram_hash import EngramHashSpec
    return EngramHashSpec.from_config(cfg)
