"""The LM head split over the CP group by vocabulary, and how a step's logits leave the group
(docs/architecture.md §8, docs/neuron.md §5.6).

CP rank r holds the head rows of tokens [r * V/cp, (r + 1) * V/cp) (model_executor/shard_plan.py), so
each rank of a CP group computes every row's logits over its slice. Per step the runner picks one of
two ways out of the group (`head_plan`, from the step's sampling requests):

- candidates (`HeadPlan.count` = m >= 1): each rank keeps, per row, the first m tokens of its slice in
  the stable descending order (ties: lowest token id first) of the key the sampler ranks by: the raw
  logits for greedy rows, logits x (1/T) for sampled rows, banned ids -inf in both. One all-gather
  of [values | ids] over the group brings cp x m candidates per row; the driver scatters their raw
  logits into a row of -inf and runs the unchanged Sampler on it. Exact, not approximate: the global
  first k of that order lie in the ranks' first k (a token ahead of another globally is ahead of it
  in its own slice, whose ids keep their order), every op the Sampler applies to such a row (the
  1/T scaling, bans, top-k, min-p after it, log_softmax, the seeded fp64 draw, ranks and top
  logprobs) only reads the kept tokens, and -inf outside them is what top-k leaves there anyway.
- the whole vocabulary (`count` 0, or no plan): one all-gather of the slices; for steps whose rows
  read the whole distribution: logit_bias, presence / frequency / repetition penalties, a grammar
  mask, top-p (it sums probabilities over the vocabulary), min-p without top-k, logprobs of greedy
  rows or of rows without top-k (the processed distribution then spans the vocabulary), prompt
  logprobs, runs without sampling (speculative verification, tests), and top-k above MAX_CANDIDATES.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepinfer.distributed import comm

# Largest top-k served from candidates; a row asking for more takes the whole vocabulary.
MAX_CANDIDATES = 256
# Bans travel with the plan in the step message (distributed/step_codec.py); more than this many in
# one step take the whole vocabulary instead, which keeps the message within its ring slot's headroom.
MAX_PLAN_BANS = 1024
NEG_INF = float("-inf")


@dataclass
class HeadPlan:
    """How one step's logits rows leave the CP group; rows in the order of the logits rows."""
    count: int                                   # candidates a rank keeps per row (>= 1)
    temperatures: list[float] = field(default_factory=list)   # per row; 1.0 for greedy rows
    bans: list[tuple[int, int]] = field(default_factory=list)  # (row, token id) pairs

    def rows(self, which: Sequence[int]) -> "HeadPlan":
        """The plan of rows `which` (in that order), renumbered from 0."""
        where = {r: i for i, r in enumerate(which)}
        return HeadPlan(self.count, [self.temperatures[r] for r in which],
                        [(where[r], t) for r, t in self.bans if r in where])

    def to_json(self) -> dict:
        return {"count": self.count, "temperatures": self.temperatures, "bans": [list(b) for b in self.bans]}

    @classmethod
    def from_json(cls, d: dict) -> "HeadPlan":
        return cls(int(d["count"]), [float(t) for t in d["temperatures"]], [(int(r), int(t)) for r, t in d["bans"]])


def head_plan(params_list, banned_ids_per_row=None, scored: bool = False) -> HeadPlan | None:
    """The candidate plan of a step whose rows are sampled with `params_list` (SamplingParams per
    logits row), or None when some row needs the whole vocabulary (module docstring)."""
    if scored or not params_list:
        return None
    need_logprobs = any(p.logprobs is not None for p in params_list)
    count, temps, bans = 1, [], []
    for i, p in enumerate(params_list):
        if p.logit_bias or p.penalises_output or p.penalises_repetition:
            return None
        if p.is_greedy:
            if need_logprobs:
                return None
            temps.append(1.0)
        else:
            if p.top_k < 1 or p.top_k > MAX_CANDIDATES or p.top_p < 1.0:
                return None
            count = max(count, int(p.top_k))
            temps.append(float(p.temperature))
        bans += [(i, int(t)) for t in (banned_ids_per_row[i] if banned_ids_per_row else ())]
    if len(bans) > MAX_PLAN_BANS:
        return None
    return HeadPlan(count, temps, bans)


def stable_top(key: torch.Tensor, m: int) -> torch.Tensor:
    """Column indices [N, m], ascending, of each row's first m entries in the stable descending order
    of key (ties: lower index first): all entries above the m-th value, then the lowest-index ones
    equal to it. torch.topk alone leaves the order of ties unspecified. Fixed shapes throughout (the
    kept columns come first in a stable sort of the mask), so a compiled region could hold it."""
    kth = torch.topk(key, m, dim=-1, sorted=True).values[:, m - 1:m]
    above = key > kth
    equal = key == kth
    keep = above | (equal & (equal.cumsum(dim=-1) <= m - above.sum(dim=-1, keepdim=True)))
    if not torch.compiler.is_compiling() and not bool((keep.sum(dim=-1) == m).all()):
        raise ValueError("vocabulary candidates: a logits row holds NaN, which has no place in the order")
    return torch.sort(keep.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :m]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary and the CP group that holds the others."""
    start: int
    size: int
    vocab: int
    world: int
    group: object = None

    @classmethod
    def of(cls, plan, parallel) -> "VocabShard | None":
        """The shard of a rank of a split model (ShardPlan, ParallelGroups); None with one CP rank or a
        CP group that does not divide the vocabulary (the head stays whole, ShardPlan.vocab_split)."""
        if plan is None or not plan.vocab_split:
            return None
        if plan.cfg.vocab_size >= 1 << 24:
            raise ValueError(f"vocab_size {plan.cfg.vocab_size}: candidate ids travel as exact fp32 (< 2**24)")
        v = plan.vocab
        return cls(v.start, len(v), plan.cfg.vocab_size, plan.layout.cp, parallel.cp)

    def _by_row(self, gathered: torch.Tensor, n: int) -> torch.Tensor:
        """[cp * n, w] in rank order -> [n, cp * w]: each row's blocks side by side, rank order."""
        return gathered.view(self.world, n, -1).permute(1, 0, 2).reshape(n, -1)

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """[N, V] from every rank's [N, V / cp] (one all-gather over the CP group)."""
        return self._by_row(comm.all_gather(local.contiguous(), self.group), local.shape[0])

    def candidates(self, local: torch.Tensor, plan: HeadPlan) -> torch.Tensor:
        """fp32 [N, 2 * m] of this rank: per row its m candidates' logits (banned ids -inf), then
        their token ids."""
        n = local.shape[0]
        x = local.float().clone()
        if plan.bans:
            rows, ids = torch.tensor(plan.bans, dtype=torch.long, device=x.device).t()
            mine = (ids >= self.start) & (ids < self.start + self.size)
            x[rows[mine], ids[mine] - self.start] = NEG_INF
        # the sampler's scaling (layers/sampler.py: fp32 reciprocal of the fp32 temperature), so ties
        # that the rounding creates are ranked as the sampler ranks them
        inv_t = torch.reciprocal(torch.tensor(plan.temperatures[:n], dtype=torch.float32, device=x.device))
        cols = stable_top(x * inv_t.unsqueeze(1), min(plan.count, self.size))
        return torch.cat([x.gather(1, cols), (cols + self.start).float()], dim=1)

    def leave_group(self, local: torch.Tensor, plan: HeadPlan | None) -> torch.Tensor:
        """What this rank's logits rows [N, V / cp] become for the gather to the driver: the whole
        rows [N, V] (no plan), or the CP group's candidates [N, cp * 2m]."""
        if plan is None:
            return self.gather_full(local)
        return self._by_row(comm.all_gather(self.candidates(local, plan), self.group), local.shape[0])

    def candidate_logits(self, rows: torch.Tensor, plan: HeadPlan | None) -> torch.Tensor:
        """The logits the driver samples from: rows as they came back (no plan), or [N, V] fp32 with
        every candidate's logit at its token id and -inf elsewhere."""
        if plan is None:
            return rows
        n = rows.shape[0]
        m = min(plan.count, self.size)
        blocks = rows.view(n, self.world, 2, m)
        out = torch.full((n, self.vocab), NEG_INF, dtype=torch.float32, device=rows.device)
        return out.scatter_(1, blocks[:, :, 1].reshape(n, -1).long(), blocks[:, :, 0].reshape(n, -1))
