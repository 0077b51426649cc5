"""Batched sampler over fp32 logits [N, V], following model.md §6.

Per row, in order (all fp32):
  0. banned token ids -> -inf (min_tokens: EOS and stop_token_ids until enough tokens exist);
  1. logits * (1/T), the fp32 reciprocal of the fp32 temperature (DI multiplies by the reciprocal);
     greedy rows use T = 1e-5 with top-p/top-k off (SamplingParams resets them);
  2. top-p: softmax, stable descending sort of the probs, drop tokens whose exclusive cumsum > top_p;
  3. top-k: stable descending rank of the remaining logits, drop rank >= top_k;
  4. min-p (not in DI; vLLM semantics): drop tokens with prob < min_p * max prob. Applied last,
     so top-p above sees the distribution before min-p (vLLM applies min-p before top-p/top-k;
     the two orders agree unless top-p and min-p are both set);
  5. logprobs = log_softmax (the processed distribution, model.md §6.1 step 4);
  6. draw: u from splitmix64 keyed by (seed, position, case) (§6.2), token = first i with the fp64
     cdf_i > u * cdf_last. Greedy rows short-cut to argmax (lowest index on ties, §6.3).

Every operation is row-local (softmax, sort, cumsum, topk and max along the vocab axis), so a row's
result depends only on its own logits and parameters: batch invariance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from deepinfer.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_U64 = np.uint64
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
MTP_SEED_OFFSET = 1000000007  # DI _MTP_SEED_OFFSET: draft sampling uses seed + this
CASE_SAMPLE, CASE_RESAMPLE, CASE_VERIFY = 0, 1, 2
_MASK64 = (1 << 64) - 1

_unseeded_rng = random.Random()


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (numpy uint64 array arithmetic wraps mod 2**64)."""
    z = np.asarray(z, dtype=_U64) + _U64(GOLDEN_GAMMA)
    z = (z ^ (z >> _U64(30))) * _U64(_MIX1)
    z = (z ^ (z >> _U64(27))) * _U64(_MIX2)
    return z ^ (z >> _U64(31))


def _u64_array(values: Sequence[int]) -> np.ndarray:
    return np.array([int(v) & _MASK64 for v in values], dtype=_U64).reshape(-1)


def _to_unit(z: np.ndarray) -> np.ndarray:
    # The top 53 bits, scaled by 2**-53: exact in float64, in [0, 1).
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_uniforms(seeds: Sequence[int], positions: Sequence[int], case: int = CASE_SAMPLE) -> np.ndarray:
    """u for a sample draw (case 0) or a rejection resample (case 1), model.md §6.2."""
    pos = _u64_array(positions)
    s = (pos * _U64(3) + _U64(case)) * _U64(GOLDEN_GAMMA)
    return _to_unit(splitmix64(_u64_array(seeds) + (s ^ (s << _U64(13)))))


def verify_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """u for the accept/reject test of speculative verification, model.md §6.2."""
    pos = _u64_array(positions)
    return _to_unit(splitmix64(_u64_array(seeds) ^ ((pos * _U64(3) + _U64(CASE_VERIFY)) * _U64(GOLDEN_GAMMA))))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, sparse: bool = True) -> torch.Tensor:
    """Inverse-CDF draw per row: first i with fp64 cdf_i > u * cdf_last. probs may be unnormalised.

    Zero-probability tokens add exactly 0.0 to a sequential fp64 cumsum, so when most of a row
    is zero (top-k/top-p) the cdf is built over the nonzero entries only: the same bits, less work.
    `sparse=False` skips the check (no filter was applied, so rows are dense).
    """
    rows, vocab = probs.shape
    u = uniforms.to(torch.float64).reshape(-1, 1)
    counts = torch.count_nonzero(probs, dim=-1) if sparse else None
    width = int(counts.max()) if counts is not None and rows else vocab
    if width == 0 or width > vocab // 4:
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        over = idx >= vocab
        if bool(over.any()):
            # u * cdf_last can round up to cdf_last: take the last token that has probability.
            last = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
            idx = torch.where(over, last, idx)
        return idx
    row_of, col_of = (probs > 0).nonzero(as_tuple=True)  # row-major: columns ascend within a row
    slot = torch.arange(row_of.numel(), device=probs.device) - (counts.cumsum(0) - counts)[row_of]
    packed = torch.zeros(rows, width, dtype=torch.float64, device=probs.device)
    packed[row_of, slot] = probs[row_of, col_of].double()
    cols = torch.zeros(rows, width, dtype=torch.int64, device=probs.device)
    cols[row_of, slot] = col_of
    cdf = packed.cumsum(dim=-1)
    j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    j = torch.minimum(j, (counts - 1).clamp(min=0))
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step, plus the row groups that pick the fast paths."""

    temperatures: torch.Tensor  # [N] f32, greedy rows 1e-5
    top_ps: torch.Tensor  # [N] f32
    top_ks: torch.Tensor  # [N] int64, -1 = disabled
    min_ps: torch.Tensor  # [N] f32
    uniforms: torch.Tensor  # [N] f64, the §6.2 draw per row
    greedy_rows: torch.Tensor  # [G] int64
    random_rows: torch.Tensor  # [R] int64
    banned_rows: torch.Tensor  # [B] int64 (row of each banned id)
    banned_ids: torch.Tensor  # [B] int64
    need_logprobs: bool
    num_top_logprobs: int  # k of top_ids/top_logprobs (max requested), 0 = none
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool

    @property
    def num_rows(self) -> int:
        return self.temperatures.shape[0]

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        sample_positions: Sequence[int],
        seeds: Sequence[int | None] | None = None,
        banned_ids_per_row: Sequence[Sequence[int]] | None = None,
        need_logprobs: bool | None = None,
        device: torch.device | str = "cpu",
        rng: random.Random | None = None,
    ) -> "SamplingBatch":
        """Tensors for rows params_list[i] at sample position sample_positions[i].

        seeds: None -> each row uses params.seed; else seeds[i] is the row's seed (u64 wrap, so a
        draft stream may pass seed + MTP_SEED_OFFSET). Rows without a seed draw a random 64-bit one
        from `rng` (default: a process-wide random.Random).
        need_logprobs: None -> only if some row asks for logprobs; True forces the sampled token's
        logprob for every row.
        """
        n = len(params_list)
        if len(sample_positions) != n:
            raise ValueError(f"sample_positions must have {n} entries (got {len(sample_positions)})")
        if seeds is not None and len(seeds) != n:
            raise ValueError(f"seeds must have {n} entries (got {len(seeds)})")
        if banned_ids_per_row is not None and len(banned_ids_per_row) != n:
            raise ValueError(f"banned_ids_per_row must have {n} entries (got {len(banned_ids_per_row)})")
        if any(int(p) < 0 for p in sample_positions):
            raise ValueError("sample_positions must be >= 0")
        rng = rng or _unseeded_rng
        row_seeds = []
        for i, p in enumerate(params_list):
            s = p.seed if seeds is None else seeds[i]
            row_seeds.append(rng.getrandbits(64) if s is None else int(s))
        greedy = [p.is_greedy for p in params_list]
        temps = [GREEDY_TEMPERATURE if g else float(p.temperature) for g, p in zip(greedy, params_list)]
        top_ps = [1.0 if g else float(p.top_p) for g, p in zip(greedy, params_list)]
        top_ks = [-1 if g or p.top_k < 1 else int(p.top_k) for g, p in zip(greedy, params_list)]
        min_ps = [0.0 if g else float(p.min_p) for g, p in zip(greedy, params_list)]
        b_rows, b_ids = [], []
        for i, ids in enumerate(banned_ids_per_row or []):
            for t in ids:
                if int(t) < 0:
                    raise ValueError(f"banned token ids must be >= 0 (got {t} in row {i})")
                b_rows.append(i)
                b_ids.append(int(t))
        requested = [p.logprobs for p in params_list if p.logprobs is not None]
        if need_logprobs is None:
            need_logprobs = bool(requested)
        num_top = max(requested, default=0) if need_logprobs else 0
        long = dict(dtype=torch.int64, device=device)
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, **long),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            uniforms=torch.from_numpy(sample_uniforms(row_seeds, sample_positions)).to(device),
            greedy_rows=torch.tensor([i for i in range(n) if greedy[i]], **long),
            random_rows=torch.tensor([i for i in range(n) if not greedy[i]], **long),
            banned_rows=torch.tensor(b_rows, **long),
            banned_ids=torch.tensor(b_ids, **long),
            need_logprobs=need_logprobs,
            num_top_logprobs=num_top,
            any_top_p=any(p < 1.0 for p in top_ps),
            any_top_k=any(k >= 1 for k in top_ks),
            any_min_p=any(m > 0.0 for m in min_ps),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] f32, sampled token under the processed distribution
    token_ranks: torch.Tensor | None = None  # [N] int64, 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None  # [N, k] int64, k = batch.num_top_logprobs
    top_logprobs: torch.Tensor | None = None  # [N, k] f32


_TOP_P_PROBES = (1024, 16384)


def _stable_top(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first m entries of the stable descending sort (ties: lower index first), via topk.

    topk leaves the order of equal values unspecified; re-sorting its indices ascending and then
    stable-sorting by value restores index order inside each run of ties. A run cut by the m
    boundary may miss lower indices beyond it, so callers only trust runs that end before m.
    """
    top_vals, top_idx = torch.topk(values, m, dim=-1, sorted=True)
    top_idx, by_index = top_idx.sort(dim=-1)
    top_vals, order = top_vals.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
    return top_vals, top_idx.gather(1, order)


def _top_p_full(x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> None:
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p.unsqueeze(1)
    x.masked_fill_(torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted), float("-inf"))


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: drop tokens whose exclusive cumulative prob, in stable descending order, > top_p.

    Same result as a full stable sort (kept below as the fallback), but usually only the first
    1024 entries of the order are built: once the exclusive cumsum there exceeds top_p, every later
    token is dropped too (the cumsum only grows).
    """
    probs = torch.softmax(x, dim=-1)
    vocab = x.shape[-1]
    pending = torch.arange(x.shape[0], device=x.device)
    for m in _TOP_P_PROBES:
        if m >= vocab or pending.numel() == 0:
            break
        p = probs.index_select(0, pending)
        limit = top_p.index_select(0, pending).unsqueeze(1)
        vals, idx = _stable_top(p, m)
        # The fp32 cumsum of a prefix equals the prefix of the full row's cumsum (it is sequential).
        drop = (vals.cumsum(dim=-1) - vals) > limit
        last_kept = m - 1 - (~drop).flip(-1).int().argmax(dim=-1, keepdim=True)
        # Trust the probe if the tail is dropped and the last kept value's tie run ends inside it.
        done = drop[:, -1] & (vals.gather(1, last_kept).squeeze(1) > vals[:, -1])
        if bool(done.any()):
            rows = pending[done]
            kept = torch.full((rows.numel(), vocab), float("-inf"), dtype=x.dtype, device=x.device)
            src = x.index_select(0, rows).gather(1, idx[done]).masked_fill(drop[done], float("-inf"))
            x.index_copy_(0, rows, kept.scatter_(1, idx[done], src))
        pending = pending[~done]
    if pending.numel():
        part = x.index_select(0, pending)
        _top_p_full(part, probs.index_select(0, pending), top_p.index_select(0, pending))
        x.index_copy_(0, pending, part)


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place: keep the top_k logits by stable descending rank (ties: lower index first).

    No full sort: the k-th largest value v bounds the set; every value > v stays, and of the
    values == v only the first (k - #greater) by index, which is exactly the stable rank order.
    """
    vocab = x.shape[-1]
    k = top_k.clamp(min=1, max=vocab).unsqueeze(1)
    kth = torch.topk(x, int(k.max()), dim=-1, sorted=True).values.gather(1, k - 1)
    greater = x > kth
    equal = x == kth
    room = k - torch.count_nonzero(greater, dim=-1).unsqueeze(1)
    if bool((torch.count_nonzero(equal, dim=-1).unsqueeze(1) > room).any()):
        equal &= equal.cumsum(dim=-1) <= room
    x.masked_fill_(~(greater | equal), float("-inf"))


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens with prob < min_p * max prob (vLLM's min-p)."""
    probs = torch.softmax(x, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    x.masked_fill_(probs < threshold, float("-inf"))


class Sampler:
    """Samples one token per row; see the module docstring for the exact transform."""

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 0-4 for `rows` (all when None): a new fp32 [R, V] tensor; `logits` is untouched."""
        inv_t = torch.reciprocal(batch.temperatures)
        if rows is None:
            x = logits.float() * inv_t.unsqueeze(1)
        else:
            x = logits.index_select(0, rows).float() * inv_t.index_select(0, rows).unsqueeze(1)
        if batch.banned_ids.numel():
            # After the scaling: -inf * (1/T) would be -inf anyway, and this saves a copy.
            self._ban(x, batch, rows)
        for flag, values, active, fn in (
            (batch.any_top_p, batch.top_ps, lambda v: v < 1.0, apply_top_p),
            (batch.any_top_k, batch.top_ks, lambda v: v >= 1, apply_top_k),
            (batch.any_min_p, batch.min_ps, lambda v: v > 0.0, apply_min_p),
        ):
            if not flag:
                continue
            row_values = values if rows is None else values.index_select(0, rows)
            sub = active(row_values).nonzero().squeeze(1)
            if sub.numel() == x.shape[0]:
                fn(x, row_values)
            elif sub.numel():
                part = x.index_select(0, sub)
                fn(part, row_values.index_select(0, sub))
                x.index_copy_(0, sub, part)
        return x

    def processed_logprobs(self, logits: torch.Tensor, batch: SamplingBatch,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
        """log_softmax of the processed logits (§6.1 step 4), for `rows` (all when None)."""
        return torch.log_softmax(self.processed_logits(logits, batch, rows), dim=-1)

    @staticmethod
    def _ban(x: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None) -> None:
        if rows is None:
            x[batch.banned_rows, batch.banned_ids] = float("-inf")
            return
        # Map each banned (row, id) onto its position within `rows`; bans of other rows are dropped.
        where = torch.full((batch.num_rows,), -1, dtype=torch.int64, device=x.device)
        where[rows] = torch.arange(rows.numel(), device=x.device)
        local = where[batch.banned_rows]
        ok = local >= 0
        x[local[ok], batch.banned_ids[ok]] = float("-inf")

    def _greedy(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.greedy_rows
        g = logits.index_select(0, rows).float()
        if batch.banned_ids.numel():
            self._ban(g, batch, rows)
        # torch.argmax returns the first maximal index: the lowest index on ties (§6.3).
        return g.argmax(dim=-1)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of logits [N, V] (fp32, or cast to it)."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, V] (got {tuple(logits.shape)})")
        n = logits.shape[0]
        num_random = batch.random_rows.numel()
        token_ids = torch.empty(n, dtype=torch.int64, device=logits.device)
        if batch.greedy_rows.numel():
            token_ids.index_copy_(0, batch.greedy_rows, self._greedy(logits, batch))
        if not batch.need_logprobs and num_random == 0:
            return SamplerOutput(token_ids=token_ids)
        # Rows to process: all of them when logprobs are wanted or every row samples.
        rows = None if batch.need_logprobs or num_random == n else batch.random_rows
        logprobs = self.processed_logprobs(logits, batch, rows)
        if num_random:
            lp = logprobs if num_random == logprobs.shape[0] else logprobs.index_select(0, batch.random_rows)
            # DI draws from exp(log_softmax), not from a separate softmax.
            filtered = batch.any_top_p or batch.any_top_k or batch.any_min_p or batch.banned_ids.numel() > 0
            drawn = sample_from_probs(lp.exp(), batch.uniforms.index_select(0, batch.random_rows), filtered)
            token_ids.index_copy_(0, batch.random_rows, drawn)
        if not batch.need_logprobs:
            return SamplerOutput(token_ids=token_ids)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))
        out = SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen.squeeze(1),
            token_ranks=(logprobs > chosen).sum(dim=-1) + 1,
        )
        if batch.num_top_logprobs > 0:
            k = min(batch.num_top_logprobs, logprobs.shape[-1])
            top = torch.topk(logprobs, k, dim=-1, sorted=True)
            out.top_ids, out.top_logprobs = top.indices, top.values
        return out

    __call__ = forward
