"""Which part of each checkpoint tensor one rank holds (docs/neuron.md §5.5, §5.6): pure arithmetic
from the model config and the rank's ParallelLayout, shared by the model (module sizes) and the
loader (which slices of the safetensors it reads).

- Attention lanes: heads are split over the `attn_tp` ranks of a lane (lane rank r holds heads
  [r * H/attn_tp, (r + 1) * H/attn_tp)). A rank keeps its heads' rows of wq_b, its heads' attn_sink
  entries, the wo_a rows of its output groups (and, when it holds only part of a group, the input
  columns of its heads) and the matching wo_b input columns. Everything else is replicated.
- Expert parallelism: the routed experts of each MoE are split over the EP group in contiguous
  ranges (ep rank r holds [r * E/ep, (r + 1) * E/ep)).
- Shared expert: its intermediate units are split over runs of s = gcd(attn_tp, ep) consecutive
  ranks (the attention lane, or the part of it inside an EP group): run rank j holds units
  [j * I/s, (j + 1) * I/s), those rows of w1 / w3 (column-parallel) and those input columns of w2
  (row-parallel). Its partial output, weighted s/ep, joins the routed partials in the MoE combine the
  layer already issues over the EP group, which holds ep/s such runs (layers/ep_moe.py).
- Vocabulary: with cp > 1 the LM head's rows are split over the CP group (cp rank r holds tokens
  [r * V/cp, (r + 1) * V/cp)); the ranks of a CP group run the same rows, so each computes its
  slice of every row's logits (layers/vocab_parallel.py). The embedding stays replicated.

Block-quantized tensors keep their ue8m0 grid when sliced: a slice [a, b) of a dim with block size
bs is representable in the packed form iff a % bs == 0 or [a, b) lies inside one block (the slice
then keeps that block's scale). Any other slice raises (see `block_region`); dense loading reads the
covering blocks, dequantizes them and cuts the slice, so it accepts every slice.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.model_executor.checkpoint_formats import routed_expert


@dataclass(frozen=True)
class Cut:
    """Elements [start, start + size) of dimension `dim`, whose full size is `full`."""
    dim: int
    start: int
    size: int
    full: int

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads and output groups one lane rank holds."""
    head0: int
    heads: int        # local heads
    group0: int
    groups: int       # local output groups (1 when the rank holds part of a group)
    col0: int         # first wo_a input column held, within each held group's input
    cols: int         # wo_a input columns held per group
    group_cols: int   # a group's full wo_a input width (heads per group * head_dim)

    @property
    def whole(self) -> bool:
        return self.cols == self.group_cols


def head_shard(cfg, lane_size: int, lane_rank: int) -> HeadShard:
    h, g, d = cfg.num_heads, cfg.o_groups, cfg.head_dim
    if h % lane_size:
        raise ValueError(f"attention_tp_size {lane_size} must divide num_heads {h}")
    hpr, hpg = h // lane_size, h // g
    if (hpr >= hpg and hpr % hpg) or (hpr < hpg and hpg % hpr):
        raise ValueError(f"attention_tp_size {lane_size}: {hpr} heads a rank do not tile {g} output groups "
                         f"of {hpg} heads")
    h0 = lane_rank * hpr
    if hpr >= hpg:
        return HeadShard(h0, hpr, h0 // hpg, hpr // hpg, 0, hpg * d, hpg * d)
    return HeadShard(h0, hpr, h0 // hpg, 1, (h0 % hpg) * d, hpr * d, hpg * d)


def expert_range(n_experts: int, ep_size: int, ep_rank: int) -> range:
    if n_experts % ep_size:
        raise ValueError(f"expert_parallel_size {ep_size} must divide the {n_experts} routed experts")
    per = n_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


_SHARED = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.shared_experts\.(w1|w2|w3)\.weight$")
_ATTN = re.compile(r"^((?:layers|mtp)\.\d+)\.attn\.(wq_b\.weight|wq_b\.scale|attn_sink|wo_a\.weight|wo_a\.scale|"
                   r"wo_b\.weight|wo_b\.scale)$")


class ShardPlan:
    """The slices of one rank (ParallelLayout) for a model config."""

    def __init__(self, cfg, layout: ParallelLayout):
        layout.check_model(cfg)
        self.cfg, self.layout = cfg, layout
        self.heads = head_shard(cfg, layout.attn_tp, layout.lane_rank)
        self.sharded = layout.attn_tp > 1 or layout.ep > 1 or layout.cp > 1

    @property
    def vocab_split(self) -> bool:
        """The LM head is split by vocabulary over the CP group: with cp > 1 ranks that divide the
        vocabulary evenly (every slice the same width, so one all-gather reassembles a row); otherwise
        every rank holds the whole head, as with one CP rank."""
        return self.layout.cp > 1 and self.cfg.vocab_size % self.layout.cp == 0

    @property
    def vocab(self) -> range:
        """The token ids whose LM head rows this rank holds."""
        if not self.vocab_split:
            return range(self.cfg.vocab_size)
        per = self.cfg.vocab_size // self.layout.cp
        return range(self.layout.cp_rank * per, (self.layout.cp_rank + 1) * per)

    @property
    def shared_split(self) -> int:
        """Ranks one shared expert is split over: gcd(attn_tp, ep) (1: replicated)."""
        return math.gcd(self.layout.attn_tp, self.layout.ep)

    def shared_units(self, inter: int) -> range:
        """The shared expert's intermediate units this rank holds (all of them when not split)."""
        s = self.shared_split
        if inter % s:
            raise ValueError(f"gcd(attention_tp_size, expert_parallel_size) = {s} must divide the shared "
                             f"expert's {inter} intermediate units")
        per, j = inter // s, self.layout.rank % s
        return range(j * per, (j + 1) * per)

    def experts(self, n_experts: int) -> range:
        return expert_range(n_experts, self.layout.ep, self.layout.ep_rank)

    def moe_size(self, name: str) -> int:
        """Routed experts of the MoE a tensor name (`layers.i.ffn...` / `mtp.i.ffn...`) belongs to."""
        return self.cfg.dspark_n_routed_experts if name.startswith("mtp.") else self.cfg.n_routed_experts

    def moe_experts(self, name: str) -> range | None:
        """The expert ids this rank holds in that MoE; None when experts are not split."""
        return self.experts(self.moe_size(name)) if self.layout.ep > 1 else None

    def holds(self, name: str) -> bool:
        """False for a routed expert's tensor that another EP rank holds."""
        expert = routed_expert(name)
        if expert is None or self.layout.ep == 1:
            return True
        return expert[1] in self.moe_experts(name)

    def cuts(self, name: str) -> tuple[Cut, ...]:
        """The dense-coordinate cuts of a canonical weight this rank holds a slice of (() = whole)."""
        cfg = self.cfg
        if name == "head.weight" and self.vocab_split:
            v = self.vocab
            return (Cut(0, v.start, len(v), cfg.vocab_size),)
        shared = _SHARED.match(name) if self.shared_split > 1 else None
        if shared is not None:
            inter = cfg.moe_inter_size * max(1, cfg.n_shared_experts)
            u = self.shared_units(inter)
            return (Cut(1 if shared.group(1) == "w2" else 0, u.start, len(u), inter),)
        if self.layout.attn_tp == 1:
            return ()
        m = _ATTN.match(name)
        if m is None:
            return ()
        s = self.heads
        d, r, leaf = cfg.head_dim, cfg.o_lora_rank, m.group(2)
        if leaf.startswith("wq_b"):
            return (Cut(0, s.head0 * d, s.heads * d, cfg.num_heads * d),)
        if leaf == "attn_sink":
            return (Cut(0, s.head0, s.heads, cfg.num_heads),)
        if leaf.startswith("wo_a"):
            rows = Cut(0, s.group0 * r, s.groups * r, cfg.o_groups * r)
            return (rows,) if s.whole else (rows, Cut(1, s.col0, s.cols, s.group_cols))
        return (Cut(1, s.group0 * r, s.groups * r, cfg.o_groups * r),)   # wo_b


def block_region(name: str, cut: Cut, block: int) -> tuple[int, int]:
    """Scale rows (or columns) [first, stop) that cover `cut` in a grid of `block`-sized blocks, for a
    packed slice that keeps the stored codes; raises when the slice does not fit the grid."""
    first, last = cut.start // block, (cut.stop - 1) // block
    if cut.start % block and first != last:
        raise ValueError(f"tensor {name!r}: its slice [{cut.start}, {cut.stop}) of dim {cut.dim} starts inside a "
                         f"{block}-wide scale block and crosses into the next, so it cannot stay packed; "
                         f"use weight_format='dense' or a layout whose slices fit the blocks")
    return first, last + 1


def covering(cut: Cut, block: int) -> tuple[int, int]:
    """[start, stop) of the whole blocks (clipped to the dim) that hold `cut`: what dense loading reads
    before cutting, so a dequantized slice sees its own blocks' scales."""
    start = cut.start // block * block
    return start, min(cut.full, -(-cut.stop // block) * block)


def read_slice(f, key: str, ndim: int, region: dict[int, tuple[int, int]]):
    """Only `region` ({dim: (start, stop)}) of a stored tensor, through safetensors' get_slice: the
    rest of the tensor is never read or materialized."""
    if not region:
        return f.get_tensor(key)
    return f.get_slice(key)[tuple(slice(*region[d]) if d in region else slice(None) for d in range(ndim))]


def code_regions(name: str, cuts: tuple[Cut, ...], block: tuple[int, int], packed: bool):
    """({dim: range} of the codes, {dim: range} of the scale grid, {dim: (offset, size)} still to cut after
    decoding) for block-quantized cuts of a 2-D weight. packed: read exactly the cut (the grid
    must fit, block_region); dense: read the covering blocks, cut after dequantizing."""
    codes, scales, trim = {}, {}, {}
    for c in cuts:
        b = block[c.dim]
        if packed:
            codes[c.dim] = (c.start, c.stop)
            scales[c.dim] = block_region(name, c, b)
        else:
            a0, a1 = covering(c, b)
            codes[c.dim], scales[c.dim] = (a0, a1), (a0 // b, -(-a1 // b))
            trim[c.dim] = (c.start - a0, c.size)
    return codes, scales, trim
