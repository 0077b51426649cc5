"""Seeded, batch-invariant draws (docs/model.md §6.2): splitmix64 uniforms and the fp64 inverse CDF.

A draw is keyed only by (seed, position, case), so a row's token never depends on the batch.
All u64 arithmetic is numpy uint64 on arrays, which wraps mod 2**64 as the spec requires.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_U64 = np.uint64
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
CASE_SAMPLE, CASE_RESAMPLE, CASE_VERIFY = 0, 1, 2


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array."""
    z = np.asarray(z, dtype=_U64) + _U64(GOLDEN_GAMMA)
    z = (z ^ (z >> _U64(30))) * _U64(_MIX1)
    z = (z ^ (z >> _U64(27))) * _U64(_MIX2)
    return z ^ (z >> _U64(31))


def _u64_array(values: Sequence[int]) -> np.ndarray:
    # Python ints first, so seeds >= 2**63 (a draft stream's seed + spec/proposer.py DRAFT_SEED_OFFSET)
    # wrap instead of overflowing.
    return np.array([int(v) & _MASK64 for v in values], dtype=_U64).reshape(-1)


def _to_unit(z: np.ndarray) -> np.ndarray:
    # The top 53 bits scaled by 2**-53: exact in float64, in [0, 1).
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_uniforms(seeds: Sequence[int], positions: Sequence[int], case: int = CASE_SAMPLE) -> np.ndarray:
    """u of a sample draw (case 0) or a rejection resample (case 1) per row."""
    pos = _u64_array(positions)
    s = (pos * _U64(3) + _U64(case)) * _U64(GOLDEN_GAMMA)
    return _to_unit(splitmix64(_u64_array(seeds) + (s ^ (s << _U64(13)))))


def verify_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """u of the accept/reject test in speculative verification."""
    pos = _u64_array(positions)
    return _to_unit(splitmix64(_u64_array(seeds) ^ ((pos * _U64(3) + _U64(CASE_VERIFY)) * _U64(GOLDEN_GAMMA))))


def _invert(cdf: torch.Tensor, u: torch.Tensor, limit: torch.Tensor | int) -> torch.Tensor:
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u * total, right=True).squeeze(1)
    over = idx >= limit
    if bool(over.any()):
        # u * cdf_last can round up to cdf_last: take the last token with probability, i.e. the
        # first index where the cdf reaches its final value.
        idx = torch.where(over, torch.searchsorted(cdf, total, right=False).squeeze(1), idx)
    return idx


def _draw_dense(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _invert(torch.cumsum(probs, dim=-1, dtype=torch.float64), u, probs.shape[-1])


def _draw_packed(values: torch.Tensor, row_of: torch.Tensor, col_of: torch.Tensor,
                 counts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # values[j] is the prob at (row_of[j], col_of[j]), row-major; skipped entries are exactly 0.
    # Adding 0.0 leaves a sequential fp64 sum unchanged, so this cdf has the dense cdf's bits.
    rows, width = counts.shape[0], int(counts.max())
    slot = torch.arange(row_of.numel(), device=values.device) - (counts.cumsum(0) - counts)[row_of]
    packed = torch.zeros(rows, width, dtype=torch.float64, device=values.device)
    packed[row_of, slot] = values.double()
    cols = torch.zeros(rows, width, dtype=torch.int64, device=values.device)
    cols[row_of, slot] = col_of
    j = _invert(packed.cumsum(dim=-1), u, counts)
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


def _packable(counts: torch.Tensor, vocab: int) -> bool:
    return counts.numel() > 0 and 0 < int(counts.max()) <= vocab // 4


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, sparse: bool = True) -> torch.Tensor:
    """Per row: the first i with fp64 cdf_i > u * cdf_last (probs may be unnormalised, >= 0).

    Zero-probability tokens are never chosen. `sparse` packs rows that are mostly zero first
    (same result, less work); pass False when rows are known to be dense.
    """
    u = uniforms.to(device=probs.device, dtype=torch.float64).reshape(-1, 1)
    if sparse:
        row_of, col_of = (probs > 0).nonzero(as_tuple=True)
        counts = torch.bincount(row_of, minlength=probs.shape[0])
        if _packable(counts, probs.shape[-1]):
            return _draw_packed(probs[row_of, col_of], row_of, col_of, counts, u)
    return _draw_dense(probs, u)


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor, sparse: bool = True) -> torch.Tensor:
    """sample_from_probs(logprobs.exp(), ...) (upstream DeepInfer draws from exp(log_softmax)), but
    exp only runs on finite entries when rows are mostly -inf: exp is elementwise, so the bits are
    the same, and exp(-inf) is a slow path on CPU."""
    u = uniforms.to(device=logprobs.device, dtype=torch.float64).reshape(-1, 1)
    if sparse:
        row_of, col_of = (logprobs > float("-inf")).nonzero(as_tuple=True)
        counts = torch.bincount(row_of, minlength=logprobs.shape[0])
        if _packable(counts, logprobs.shape[-1]):
            return _draw_packed(logprobs[row_of, col_of].exp(), row_of, col_of, counts, u)
    return _draw_dense(logprobs.exp(), u)
