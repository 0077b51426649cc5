"""DSpark block drafting of the V4.1 `mtp.{i}` layers (docs/model.md §3.8).

Two halves, both reading the main model's weights and caches:

- `write_main_keys`, inside every main forward once drafting is on (prefill chunks and verification
  rows alike): the stream means at the target layers' attention inputs (after Engram, collected in
  `StepContext.targets`) are concatenated, projected by `mtp.0.main_proj` and normed (m_t); each
  draft layer i stores its main key kappa_i = RoPE(RMS(m_t W_kv,i^T; kv_norm_i), t) in its own window
  ring, at the rows the main layers' window writes use (same slot, same position).
- `draft_forward`, after a step sampled: a block [x0, noise, ..., noise] of B tokens at positions
  a+1 .. a+B (a = the last position whose main key is cached, x0 = the token just emitted) goes
  through the draft layers (shifted HC, window-only attention, the draft MoE). Every block query
  attends to the same W + B keys: the W main keys of positions a-W+1 .. a from the ring plus all B
  block keys, with no causal mask inside the block, and the sink. HC post and collapse with the
  last pre mix give hidden_pre; the base logits are head . RMS(hidden_pre; mtp norm).

Block row k predicts the token at position a+2+k. The Markov head (`markov_logits`) and the
confidence head (`confidence`) depend on the previous token of the block path (x0, then the draft
sampled at k-1), so the proposer samples the drafts one depth at a time (spec/proposer.py), calling
`draft_heads` per depth. Rows whose drafts are plain argmaxes (`greedy_drafts`: no logits processing,
lowest id on ties, as the sampler's greedy rows) can take all depths in one go, inside the draft
block's compiled region on Neuron (worker/runners/neuron_regions.py), so no logits leave the device.

Block keys are not written to the ring: the verification forward writes the main keys of the same
positions before any draft block reads them (docs/model.md §5.3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model_executor.forward_meta import CacheLayout, StepInputs
from deepinfer.model_executor.layers.head_gemm import head_logits
from deepinfer.model_executor.layers.packed_weights import is_packed, linear_mm
from deepinfer.model_executor.models.v4_common import StepContext

CONFIDENCE_TEMPERATURE = 1.0  # upstream DeepInfer's default T_c (docs/model.md §3.8 step 6)
CONFIDENCE_CLAMP = 60.0


def check_draftable(cfg) -> None:
    """Speculative decoding needs a V4.1 checkpoint with DSpark draft layers."""
    if not cfg.is_v41:
        raise ValueError("num_speculative_tokens > 0 needs a deepseek_v41 checkpoint (DSpark draft layers); "
                         f"this one is {cfg.model_type!r}")
    if not cfg.num_nextn_predict_layers:
        raise ValueError("num_speculative_tokens > 0 needs a checkpoint with draft layers "
                         "(num_nextn_predict_layers = 0 here)")
    if not cfg.hc_shifted:
        raise ValueError("DSpark drafting runs the shifted HC path (hc_shifted must be true)")


def target_features(model, ctx: StepContext) -> torch.Tensor:
    """F = concat_tau f_tau(t) [T, D * targets], in dspark_target_layer_ids order."""
    return torch.cat([ctx.targets[t] for t in model.cfg.dspark_target_layer_ids], dim=-1)


def project_features(model, f: torch.Tensor) -> torch.Tensor:
    """m = RMS(F . W_main^T; main_norm)."""
    k, blk = model.kernels, model.mtp[0]
    return k.rms_norm(linear_mm(f, blk.main_proj, k), blk.main_norm.weight, model.cfg.rms_norm_eps)


def main_features(model, ctx: StepContext, rows: torch.Tensor | None = None) -> torch.Tensor:
    """m_t = RMS(concat_tau f_tau(t) . W_main^T; main_norm) for the step's tokens (`rows` of them)."""
    f = target_features(model, ctx)
    if rows is not None:
        f = f.index_select(0, rows)
    return project_features(model, f)


def main_key(model, blk, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kappa = RoPE(RMS(m . W_kv^T; kv_norm)) of one draft layer (its own wkv and the main rope)."""
    k, attn = model.kernels, blk.attn
    return k.rope(k.rms_norm(linear_mm(m, attn.wkv, k), attn.kv_norm.weight, model.cfg.rms_norm_eps), cos, sin)


def write_main_keys(model, ctx: StepContext) -> None:
    """Store every draft layer's main keys of the step's window writes (same rows as the main rings),
    and of the prefix-cache snapshot rows (model_executor/prefix_state.py)."""
    step, cache = ctx.step, ctx.cache
    _snapshot_main_keys(model, ctx)
    src = step.swa_write_src
    if not src.numel():
        return
    m = main_features(model, ctx, src)
    cos, sin = ctx.rope("main")
    cos, sin = cos.index_select(0, src), sin.index_select(0, src)
    for blk in model.mtp:
        cache.swa[blk.layer][step.swa_write_dst] = cache.formats.swa.encode(main_key(model, blk, m, cos, sin))


def _snapshot_main_keys(model, ctx: StepContext) -> None:
    """Draft layers' snapshot rows: ring rows of earlier steps as they are, this step's from its features
    (before the ring writes of this step replace any of them)."""
    step, cache = ctx.step, ctx.cache
    copies = step.prefix.swa if step.prefix is not None else None
    if copies is None or not copies.snap_dst.numel() or not cache.swa_snap:
        return
    ring_rows = cache.swa[model.mtp[0].layer].shape[0]
    in_step = copies.snap_src >= ring_rows
    rows = (copies.snap_src - ring_rows).clamp(min=0)
    m = main_features(model, ctx, rows)
    cos, sin = ctx.rope("main")
    cos, sin = cos.index_select(0, rows), sin.index_select(0, rows)
    for blk in model.mtp:
        ring = cache.swa[blk.layer]
        new = cache.formats.swa.encode(main_key(model, blk, m, cos, sin))
        old = ring[copies.snap_src.clamp(max=ring_rows - 1)]
        cache.swa_snap[blk.layer][copies.snap_dst] = torch.where(in_step[:, None], new, old)


@dataclass
class DraftBlock:
    """Rows of one draft forward: sequence r drafts from x0 = first_tokens[r] at position last_pos[r] + 1.

    The last `placeholders` rows pad a data-parallel group to the step's largest group
    (executor/step_fanout.py): scratch slot 0, their tokens select no expert, their outputs are dropped."""
    slots: list[int]
    last_pos: list[int]      # a: the last position whose main key is in the ring
    first_tokens: list[int]  # x0
    block: int               # B
    placeholders: int = 0

    def __len__(self) -> int:
        return len(self.slots)

    def rows(self, index: list[int]) -> DraftBlock:
        """The block of rows `index` (in that order; real rows only)."""
        assert not self.placeholders
        return DraftBlock([self.slots[i] for i in index], [self.last_pos[i] for i in index],
                          [self.first_tokens[i] for i in index], self.block)

    def padded(self, num_rows: int) -> DraftBlock:
        """This block with placeholder rows (scratch slot 0, position 1, token 0) up to num_rows."""
        extra = num_rows - len(self)
        return DraftBlock(self.slots + [0] * extra, self.last_pos + [0] * extra,
                          self.first_tokens + [0] * extra, self.block, self.placeholders + extra)


def draft_step_inputs(rows: DraftBlock, layout: CacheLayout, noise_id: int) -> StepInputs:
    """Metadata of a draft block: R * B tokens, each attending to W ring rows + its block's B rows."""
    r = len(rows.slots)
    real = torch.arange(r) < r - rows.placeholders
    return draft_block_inputs(torch.tensor(rows.slots, dtype=torch.long), torch.tensor(rows.last_pos, dtype=torch.long),
                              torch.tensor(rows.first_tokens, dtype=torch.long), rows.block, layout, noise_id,
                              None if bool(real.all()) else real)


def draft_block_inputs(slot: torch.Tensor, last_pos: torch.Tensor, first_tokens: torch.Tensor, block: int,
                       layout: CacheLayout, noise_id: int, real: torch.Tensor | None = None) -> StepInputs:
    """`draft_step_inputs` from int64 tensors [R] on any device: a block whose rows are known only on
    the device (spec/greedy_step.py builds it from the acceptance it computes there). real: bool [R],
    False for placeholder rows (None: every row is real)."""
    r, b, dev = slot.shape[0], block, slot.device
    w, ring = layout.window, layout.swa_ring
    a = last_pos
    ids = torch.full((r, b), int(noise_id), dtype=torch.long, device=dev)
    ids[:, 0] = first_tokens
    offs = torch.arange(b, device=dev)
    positions = (a[:, None] + 1 + offs[None, :]).reshape(-1)
    main_pos = a[:, None] - (w - 1) + torch.arange(w, device=dev)[None, :]              # [R, W]
    main_rows = slot[:, None] * ring + torch.remainder(main_pos.clamp(min=0), ring)
    block_rows = layout.num_slots * ring + torch.arange(r, device=dev)[:, None] * b + offs[None, :]  # after the ring
    idx = torch.cat([main_rows, block_rows], dim=1)
    valid = torch.cat([main_pos >= 0, torch.ones(r, b, dtype=torch.bool, device=dev)], dim=1)
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    return StepInputs(
        input_ids=ids.reshape(-1), positions=positions, logits_indices=torch.arange(r * b, device=dev),
        swa_idx=idx.repeat_interleave(b, dim=0), swa_valid=valid.repeat_interleave(b, dim=0),
        swa_write_src=empty, swa_write_dst=empty,
        token_valid=None if real is None else real.repeat_interleave(b))


def draft_forward(model, step: StepInputs, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_pre [R*B, D], base logits fp32) of a draft block step (module docstring): this rank's
    head columns, [R*B, V] (or its vocabulary slice), or its draft-vocabulary columns; `model.draft_columns`
    makes them every draft column."""
    cfg, k = model.cfg, model.kernels
    ctx = StepContext(model, step, cache)
    e = model.embed.weight[step.input_ids]
    x = e[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    prev_pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
    prev_pre[:, 0] = 1.0
    for blk in model.mtp:
        x, prev_pre = blk(x, prev_pre, ctx, blk.layer_io(ctx))
    hidden = k.hc_pre(x, prev_pre)
    last = model.mtp[-1]
    normed = k.rms_norm(hidden, last.norm.weight, cfg.rms_norm_eps)
    dv = model.draft_vocab
    if dv is None:
        return hidden, model.compute_logits(normed)
    # only the draft vocabulary's rows of the head (models/draft_vocab.py): this rank's columns
    return hidden, head_logits(normed, dv.head.weight, getattr(dv.head, "weight_bf16", None))


def pad_draft_tokens(step: StepInputs, tokens: int, layout: CacheLayout) -> StepInputs:
    """A draft block step padded with placeholder tokens to `tokens` (a power of two on Neuron,
    docs/neuron.md §4 B3). Each placeholder token attends to its own block key only (one valid column,
    so its softmax is finite), sits at position 1 with token 0 and selects no expert; the real tokens
    never see it (their block columns name their own block's rows). Outputs of the placeholders come
    after every real row and are dropped."""
    t = step.input_ids.numel()
    extra = tokens - t
    if extra <= 0:
        return step
    width, dev = step.swa_idx.shape[1], step.input_ids.device   # a block built on the device pads there
    own = layout.num_slots * layout.swa_ring + torch.arange(t, tokens, device=dev)      # rows after the ring
    valid = torch.zeros(extra, width, dtype=torch.bool, device=dev)
    valid[:, 0] = True
    real = torch.ones(t, dtype=torch.bool, device=dev) if step.token_valid is None else step.token_valid
    cat = torch.cat
    return StepInputs(
        input_ids=cat([step.input_ids, torch.zeros(extra, dtype=torch.long, device=dev)]),
        positions=cat([step.positions, torch.ones(extra, dtype=torch.long, device=dev)]),
        logits_indices=torch.arange(tokens, device=dev),
        swa_idx=cat([step.swa_idx, own[:, None].expand(extra, width)]), swa_valid=cat([step.swa_valid, valid]),
        swa_write_src=step.swa_write_src, swa_write_dst=step.swa_write_dst,
        token_valid=cat([real, torch.zeros(extra, dtype=torch.bool, device=dev)]))


def greedy_drafts(model, hidden: torch.Tensor, base: torch.Tensor, first_tokens: torch.Tensor,
                  depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [R, B] int64, confidences [R, B] fp32) of R block rows of B = depth tokens when every
    draft is the argmax of its depth's logits (base + Markov of the previous draft): the lowest id on
    ties, as torch.argmax and the sampler's greedy rows (layers/sampler.py) take it (draft columns hold
    ascending ids). hidden, base: the block's first R * B rows (block order), base over every draft
    column (model.draft_columns); first_tokens: x0 [R]."""
    r = first_tokens.shape[0]
    hidden, base = hidden.view(r, depth, -1), base.view(r, depth, -1)
    prev, toks, confs = first_tokens, [], []
    for k in range(depth):
        lg, conf = draft_heads(model, hidden[:, k], base[:, k], prev)
        prev = column_token_ids(model, lg.argmax(dim=-1))
        toks.append(prev)
        confs.append(conf)
    return torch.stack(toks, dim=1), torch.stack(confs, dim=1)


def column_token_ids(model, columns: torch.Tensor) -> torch.Tensor:
    """Token ids of draft columns: the identity without a draft vocabulary (models/draft_vocab.py)."""
    dv = getattr(model, "draft_vocab", None)
    return columns if dv is None else dv.ids[columns]


def draft_heads(model, hidden: torch.Tensor, base: torch.Tensor,
                prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, C] fp32, confidence [N] fp32) of one draft depth over the draft columns C (the
    vocabulary, or a draft vocabulary's): the block row's base logits plus the Markov head's of the
    previous token (an id), and the confidence head's estimate."""
    pe = markov_embed(model, prev_ids)
    return base + markov_logits(model, pe), confidence(model, hidden, pe)


def markov_embed(model, prev_ids: torch.Tensor) -> torch.Tensor:
    """Wm1[prev]: the Markov head's low-rank embedding of the previous token."""
    return model.mtp[-1].markov_head.embed.weight[prev_ids]


def markov_logits(model, prev_e: torch.Tensor) -> torch.Tensor:
    """Wm2 . Wm1[prev] (fp32 [N, C] over the draft columns), added to the base logits of the row. A dense
    Wm2 goes through the LM head's GEMM (layers/head_gemm.py: its bf16 copy, where the platform keeps
    one); with a draft vocabulary, only its rows (models/draft_vocab.py)."""
    dv = model.draft_vocab
    if dv is not None:
        return head_logits(prev_e, dv.markov.weight, getattr(dv.markov, "weight_bf16", None))
    lin = model.mtp[-1].markov_head.head
    if is_packed(lin):
        return linear_mm(prev_e, lin, model.kernels).float()
    return head_logits(prev_e, lin.weight, getattr(lin, "weight_bf16", None))


def confidence(model, hidden: torch.Tensor, prev_e: torch.Tensor,
               temperature: float = CONFIDENCE_TEMPERATURE) -> torch.Tensor:
    """c = sigmoid(clamp([hidden_pre || Wm1[prev]] . w_conf^T / T_c, +-60)), [N] fp32."""
    proj = model.mtp[-1].confidence_head.proj
    z = linear_mm(torch.cat([hidden, prev_e.to(hidden.dtype)], dim=-1), proj, model.kernels).float()
    return torch.sigmoid(torch.clamp(z.squeeze(-1) / temperature, -CONFIDENCE_CLAMP, CONFIDENCE_CLAMP))
