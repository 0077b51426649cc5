"""Batched sampler over fp32 logits [N, V], following docs/model.md §6.

Per row, in order (all fp32):
  a. on the raw logits, in vLLM's order (logits_penalties.py): the grammar bitmask of a
     structured-output row, logit_bias, repetition_penalty, frequency_penalty, presence_penalty.
     Greedy rows take the argmax of this adjusted row;
  0. banned token ids -> -inf (min_tokens: EOS and stop_token_ids until enough tokens exist);
  1. logits * (1/T), the fp32 reciprocal of the fp32 temperature (upstream DeepInfer multiplies by the
     reciprocal); greedy rows use T = 1e-5 with top-p/top-k off;
  2. top-p: softmax, stable descending order, drop tokens whose exclusive cumsum > top_p;
  3. top-k: stable descending rank of the remaining logits, drop rank >= top_k;
  4. min-p (not in upstream DeepInfer; vLLM's definition): drop tokens with prob < min_p * max prob. It runs
     last, so top-p sees the distribution before min-p; vLLM runs min-p before top-p/top-k.
     The orders agree unless top-p and min-p are both set;
  5. logprobs = log_softmax of the result: the processed distribution (§6.1 step 4);
  6. draw: u = splitmix64(seed, position, case 0) (§6.2), token = first i with fp64
     cdf_i > u * cdf_last over exp(logprobs). Greedy rows take argmax instead (lowest index on
     ties, §6.3), which is what the T = 1e-5 path gives short of near-exact logit ties.

Every operation works along the vocab axis of one row, so a row's result depends only on its
own logits and parameters (batch invariance); tests/unit/test_sampler.py checks it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.model_executor.layers.logits_filters import apply_min_p, apply_top_k, apply_top_p
from deepinfer.model_executor.layers.logits_penalties import (
    apply_bitmask, apply_frequency_presence, apply_logit_bias, apply_repetition_penalty)
from deepinfer.model_executor.layers.row_argmax import first_argmax
from deepinfer.model_executor.layers.sample_draw import (  # noqa: F401  (re-exported)
    sample_from_logprobs, sample_from_probs, sample_uniforms, verify_uniforms)
from deepinfer.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_unseeded_rng = random.Random()


@dataclass
class SamplingBatch:
    """Per-row sampling tensors of one step, plus the flags that pick the fast paths."""

    temperatures: torch.Tensor  # [N] f32, greedy rows 1e-5
    top_ps: torch.Tensor  # [N] f32, 1 = off
    top_ks: torch.Tensor  # [N] int64, -1 = off
    min_ps: torch.Tensor  # [N] f32, 0 = off
    uniforms: torch.Tensor  # [N] f64, the §6.2 draw of each row
    greedy_rows: torch.Tensor  # [G] int64
    random_rows: torch.Tensor  # [R] int64
    banned_rows: torch.Tensor  # [B] int64, row of each banned id
    banned_ids: torch.Tensor  # [B] int64
    need_logprobs: bool
    num_top_logprobs: int  # k of top_ids/top_logprobs (the largest request), 0 = none
    # Step a (logits_penalties.py); empty tensors / None when no row uses them.
    bias_rows: torch.Tensor  # [K] int64
    bias_ids: torch.Tensor  # [K] int64
    bias_values: torch.Tensor  # [K] f32
    presence: torch.Tensor  # [N] f32, 0 = off
    frequency: torch.Tensor  # [N] f32, 0 = off
    repetition: torch.Tensor  # [N] f32, 1 = off
    output_rows: torch.Tensor  # [O] int64: one (row, id) pair per generated token of a row with
    output_ids: torch.Tensor  # [O] int64    presence / frequency penalty
    uniq_rows: torch.Tensor  # [U] int64: the distinct generated tokens of those rows
    uniq_ids: torch.Tensor  # [U] int64    (presence counts each once)
    seen_rows: torch.Tensor  # [S] int64: distinct prompt + generated tokens of a row with
    seen_ids: torch.Tensor  # [S] int64    repetition penalty
    bitmask_rows: torch.Tensor  # [M] int64, rows under a grammar
    bitmask: torch.Tensor | None  # [M, W] int32, their allowed-token words
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool

    @property
    def num_rows(self) -> int:
        return self.temperatures.shape[0]

    @property
    def any_adjust(self) -> bool:
        """Step a changes some row."""
        return (self.bitmask is not None or self.bias_ids.numel() > 0 or self.output_ids.numel() > 0
                or self.seen_ids.numel() > 0)

    @property
    def any_filter(self) -> bool:
        return self.any_top_p or self.any_top_k or self.any_min_p or self.banned_ids.numel() > 0

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
        output_ids_per_row: Sequence[Sequence[int]] | None = None,
        prompt_ids_per_row: Sequence[Sequence[int]] | None = None,
        bitmask_per_row: Sequence[torch.Tensor | None] | None = None,
    ) -> "SamplingBatch":
        """Row i samples with params_list[i] at position sample_positions[i] (the position of
        the token being produced).

        seeds: None -> row i uses params_list[i].seed; otherwise seeds[i] (taken mod 2**64, so a
        draft stream can pass seed + spec/proposer.py DRAFT_SEED_OFFSET). A row without a seed draws a random
        64-bit one from `rng` (default: a process-wide random.Random).
        banned_ids_per_row: token ids that row i may not produce (min_tokens).
        need_logprobs: None -> only when some row asks for logprobs; True -> the sampled token's
        logprob (and rank) for every row.
        output_ids_per_row / prompt_ids_per_row: row i's generated / prompt token ids, read only
        for rows whose params set a presence, frequency or repetition penalty.
        bitmask_per_row: row i's allowed-token words (int32 [W]) under a grammar, or None.
        """
        n = len(params_list)
        for name, seq in (("sample_positions", sample_positions), ("seeds", seeds),
                          ("banned_ids_per_row", banned_ids_per_row),
                          ("output_ids_per_row", output_ids_per_row),
                          ("prompt_ids_per_row", prompt_ids_per_row),
                          ("bitmask_per_row", bitmask_per_row)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name} must have one entry per row ({n}), got {len(seq)}")
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
        k_rows, k_ids, k_vals, o_rows, o_ids, u_rows, u_ids, s_rows, s_ids = [], [], [], [], [], [], [], [], []
        for i, p in enumerate(params_list):
            for t, b in (p.logit_bias or {}).items():
                k_rows.append(i)
                k_ids.append(t)
                k_vals.append(b)
            if not (p.penalises_output or p.penalises_repetition):
                continue
            outputs = list(output_ids_per_row[i]) if output_ids_per_row is not None else []
            if p.penalises_output:
                o_rows += [i] * len(outputs)
                o_ids += outputs
                distinct = list(dict.fromkeys(outputs))
                u_rows += [i] * len(distinct)
                u_ids += distinct
            if p.penalises_repetition:
                prompt = list(prompt_ids_per_row[i]) if prompt_ids_per_row is not None else []
                seen = list(dict.fromkeys(prompt + outputs))
                s_rows += [i] * len(seen)
                s_ids += seen
        masks = [(i, m) for i, m in enumerate(bitmask_per_row or []) if m is not None]
        requested = [p.logprobs for p in params_list if p.logprobs is not None]
        if need_logprobs is None:
            need_logprobs = bool(requested)
        as_long = dict(dtype=torch.int64, device=device)
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, **as_long),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            uniforms=torch.from_numpy(sample_uniforms(row_seeds, sample_positions)).to(device),
            greedy_rows=torch.tensor([i for i in range(n) if greedy[i]], **as_long),
            random_rows=torch.tensor([i for i in range(n) if not greedy[i]], **as_long),
            banned_rows=torch.tensor(b_rows, **as_long),
            banned_ids=torch.tensor(b_ids, **as_long),
            need_logprobs=need_logprobs,
            num_top_logprobs=max(requested, default=0) if need_logprobs else 0,
            any_top_p=any(p < 1.0 for p in top_ps),
            any_top_k=any(k >= 1 for k in top_ks),
            any_min_p=any(m > 0.0 for m in min_ps),
            bias_rows=torch.tensor(k_rows, **as_long),
            bias_ids=torch.tensor(k_ids, **as_long),
            bias_values=torch.tensor(k_vals, dtype=torch.float32, device=device),
            presence=torch.tensor([float(p.presence_penalty) for p in params_list],
                                  dtype=torch.float32, device=device),
            frequency=torch.tensor([float(p.frequency_penalty) for p in params_list],
                                   dtype=torch.float32, device=device),
            repetition=torch.tensor([float(p.repetition_penalty) for p in params_list],
                                    dtype=torch.float32, device=device),
            output_rows=torch.tensor(o_rows, **as_long),
            output_ids=torch.tensor(o_ids, **as_long),
            uniq_rows=torch.tensor(u_rows, **as_long),
            uniq_ids=torch.tensor(u_ids, **as_long),
            seen_rows=torch.tensor(s_rows, **as_long),
            seen_ids=torch.tensor(s_ids, **as_long),
            bitmask_rows=torch.tensor([i for i, _ in masks], **as_long),
            bitmask=(torch.stack([m.to(torch.int32).reshape(-1) for _, m in masks]).to(device)
                     if masks else None),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] f32: sampled token, processed distribution
    token_ranks: torch.Tensor | None = None  # [N] int64: its 1-based rank there
    top_ids: torch.Tensor | None = None  # [N, k] int64, k = batch.num_top_logprobs
    top_logprobs: torch.Tensor | None = None  # [N, k] f32
    # [R, V] f32, only when forward(keep_random_logprobs=True): the processed log-distribution of the
    # random rows (batch.random_rows order) the draws came from; the drafter keeps it as q
    # (spec/proposer.py) instead of recomputing it.
    random_logprobs: torch.Tensor | None = None


def logprob_output(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    """token_ids [N] with their logprob, 1-based rank and the top `num_top` entries under the
    processed logprobs [N, V]; speculative verification reports its tokens the same way."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    out = SamplerOutput(token_ids=token_ids, logprobs=chosen.squeeze(1),
                        token_ranks=torch.count_nonzero(logprobs > chosen, dim=-1) + 1)
    if num_top > 0:
        top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
        out.top_ids, out.top_logprobs = top.indices, top.values
    return out


def _on_rows(x: torch.Tensor, values: torch.Tensor, active: torch.Tensor, fn, *extra) -> None:
    """Run fn(x_rows, values_rows, *extra_rows) in place on the rows where `active` holds."""
    sub = active.nonzero().squeeze(1)
    if sub.numel() == x.shape[0]:
        fn(x, values, *extra)
    elif sub.numel():
        part = x.index_select(0, sub)
        fn(part, values.index_select(0, sub), *(e.index_select(0, sub) for e in extra))
        x.index_copy_(0, sub, part)


class Sampler:
    """Samples one token per row; the module docstring gives the exact transform."""

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Step a: a new fp32 [N, V] tensor when some row needs it, else `logits` itself."""
        if not batch.any_adjust:
            return logits
        x = logits.float().clone()
        if batch.bitmask is not None:
            apply_bitmask(x, batch.bitmask_rows, batch.bitmask)
        if batch.bias_ids.numel():
            apply_logit_bias(x, batch.bias_rows, batch.bias_ids, batch.bias_values)
        if batch.seen_ids.numel():
            apply_repetition_penalty(x, batch.seen_rows, batch.seen_ids, batch.repetition)
        if batch.output_ids.numel():
            apply_frequency_presence(x, batch.output_rows, batch.output_ids, batch.uniq_rows,
                                     batch.uniq_ids, batch.frequency, batch.presence)
        return x

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
        """Steps a-4 for `rows` (all when None): a new fp32 [R, V] tensor; `logits` is untouched."""
        return self._processed_logits(self.adjusted_logits(logits, batch), batch, rows)

    def _processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
        inv_t = torch.reciprocal(batch.temperatures)
        if rows is None:
            x = logits.float() * inv_t.unsqueeze(1)
        else:
            x = logits.index_select(0, rows).float() * inv_t.index_select(0, rows).unsqueeze(1)
        if batch.banned_ids.numel():
            # Banning after the scaling gives the same -inf and saves a copy.
            self._ban(x, batch, rows)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        top_ks = pick(batch.top_ks)
        if batch.any_top_p:
            top_ps = pick(batch.top_ps)
            _on_rows(x, top_ps, top_ps < 1.0, apply_top_p, top_ks)
        if batch.any_top_k:
            _on_rows(x, top_ks, top_ks >= 1, apply_top_k)
        if batch.any_min_p:
            min_ps = pick(batch.min_ps)
            _on_rows(x, min_ps, min_ps > 0.0, apply_min_p)
        return x

    def processed_logprobs(self, logits: torch.Tensor, batch: SamplingBatch,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
        """log_softmax of the processed logits (§6.1 step 4) for `rows` (all when None)."""
        return torch.log_softmax(self.processed_logits(logits, batch, rows), dim=-1)

    def adjusted_logprobs(self, adjusted: torch.Tensor, batch: SamplingBatch,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
        """processed_logprobs of logits that already went through adjusted_logits (step a)."""
        return torch.log_softmax(self._processed_logits(adjusted, batch, rows), dim=-1)

    @staticmethod
    def _ban(x: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None) -> None:
        if rows is None:
            x[batch.banned_rows, batch.banned_ids] = float("-inf")
            return
        # Map each banned (row, id) to its place within `rows`; bans of other rows are skipped.
        where = torch.full((batch.num_rows,), -1, dtype=torch.int64, device=x.device)
        where[rows] = torch.arange(rows.numel(), device=x.device)
        local = where[batch.banned_rows]
        ok = local >= 0
        x[local[ok], batch.banned_ids[ok]] = float("-inf")

    def greedy_tokens(self, logits: torch.Tensor, batch: SamplingBatch,
                      row_argmax: torch.Tensor | None = None) -> torch.Tensor:
        """The argmax of each greedy row (batch.greedy_rows, in order) of adjusted logits, bans applied.
        row_argmax: every row's argmax of these very logits when already known (the LM head's,
        layers/head_gemm.py head_logits_argmax): used where no ban changes the rows."""
        rows = batch.greedy_rows
        if row_argmax is not None and not batch.banned_ids.numel():
            if row_argmax.shape != (logits.shape[0],):
                raise ValueError(f"row_argmax must be [{logits.shape[0]}] (got {tuple(row_argmax.shape)})")
            return row_argmax if rows.numel() == batch.num_rows else row_argmax.index_select(0, rows)
        if rows.numel() == batch.num_rows and not batch.banned_ids.numel():
            return first_argmax(logits)
        g = logits.index_select(0, rows).float()
        if batch.banned_ids.numel():
            self._ban(g, batch, rows)
        # the first maximal index: the lowest index on ties (§6.3), as torch.argmax (layers/row_argmax.py)
        return first_argmax(g)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch,
                keep_random_logprobs: bool = False, row_argmax: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per row of logits [N, V] (fp32, other dtypes are cast). row_argmax: each
        row's argmax of `logits` when the head computed it (greedy_tokens), else None."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, V] (got {tuple(logits.shape)})")
        n = logits.shape[0]
        raw = logits
        logits = self.adjusted_logits(logits, batch)
        if logits is not raw:   # penalties, biases or a grammar changed the rows: the head's argmax is stale
            row_argmax = None
        num_random = batch.random_rows.numel()
        token_ids = torch.empty(n, dtype=torch.int64, device=logits.device)
        if batch.greedy_rows.numel():
            token_ids.index_copy_(0, batch.greedy_rows, self.greedy_tokens(logits, batch, row_argmax))
        if not batch.need_logprobs and num_random == 0:
            return SamplerOutput(token_ids=token_ids)
        # Process every row when logprobs are wanted (or all rows sample), else the random rows.
        rows = None if batch.need_logprobs or num_random == n else batch.random_rows
        logprobs = self.adjusted_logprobs(logits, batch, rows)
        lp = None
        if num_random:
            lp = logprobs if num_random == logprobs.shape[0] else logprobs.index_select(0, batch.random_rows)
            drawn = sample_from_logprobs(lp, batch.uniforms.index_select(0, batch.random_rows),
                                         sparse=batch.any_filter)
            token_ids.index_copy_(0, batch.random_rows, drawn)
        if not keep_random_logprobs:
            lp = None
        if not batch.need_logprobs:
            return SamplerOutput(token_ids=token_ids, random_logprobs=lp)
        out = logprob_output(logprobs, token_ids, batch.num_top_logprobs)
        out.random_logprobs = lp
        return out

    __call__ = forward
