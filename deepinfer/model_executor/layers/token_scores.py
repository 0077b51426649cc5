"""Scores of known tokens (prompt logprobs): how likely the model found each token given its prefix.

Unlike the sampler's logprobs (the processed distribution, after temperature and filters), these are
log_softmax of the raw fp32 logits. OpenAI's API and vLLM's prompt_logprobs report the model's own
distribution, and that is what evaluation harnesses compare across engines (a loglikelihood must not
change with the request's temperature or top-p, which are meaningless for a prompt).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenScores:
    """One row per scored token."""
    logprobs: torch.Tensor      # [R] f32: logprob of the known token
    ranks: torch.Tensor         # [R] int64: its 1-based rank (1 + tokens with a strictly larger logit)
    top_ids: torch.Tensor       # [R, k] int64, descending
    top_logprobs: torch.Tensor  # [R, k] f32


def score_tokens(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> TokenScores:
    """logits [R, V] (row r predicts target_ids[r]); num_top: k of the top lists (0: none)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = target_ids.to(device=logprobs.device, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = min(int(num_top), logprobs.shape[1])
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=1)
    else:
        top_logprobs = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.long, device=logprobs.device)
    return TokenScores(chosen.squeeze(1), ranks, top_ids, top_logprobs)
