"""What a request changes on its raw logits before temperature, as batched tensor ops on [N, V].

In the order vLLM applies them (the grammar mask first, then logit bias, then the penalties):
  1. grammar bitmask: a token whose bit is 0 gets -inf (packed 32 tokens per int32 word, bit
     i % 32 of word i // 32, xgrammar's layout);
  2. logit_bias: x[r, t] += bias;
  3. repetition_penalty p (vLLM): a token seen in the prompt or the output gets x / p if x > 0,
     else x * p;
  4. frequency_penalty f: x -= f * (times the token was generated);
  5. presence_penalty q: x -= q * (1 if the token was generated).

The token histories arrive as flat (row, token id) pairs built on the host; counts are scattered
on the device with accumulate=True, so nothing here reads device data back (no host syncs) and a
row's result depends only on its own history and parameters.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
BITS_PER_WORD = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 words -> [N, vocab] bool (True = allowed); columns past 32 * W are disallowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    # Arithmetic shift of a negative word still leaves the wanted bit in place 0.
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: rows[j] of x keeps only the tokens allowed by bitmask[j]."""
    allowed = unpack_bitmask(bitmask, x.shape[1])
    part = x.index_select(0, rows).masked_fill(~allowed, NEG_INF)
    x.index_copy_(0, rows, part)


def apply_logit_bias(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> None:
    """In place: x[rows[j], ids[j]] += bias[j] (each (row, id) pair appears once)."""
    x.index_put_((rows, ids), bias.to(x.dtype), accumulate=True)


def token_counts(num_rows: int, vocab: int, rows: torch.Tensor, ids: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] fp32: how often each id occurs among the (rows[j], ids[j]) pairs."""
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), torch.ones(rows.shape[0], dtype=torch.float32, device=device),
                      accumulate=True)
    return counts


def apply_repetition_penalty(x: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor) -> None:
    """In place: tokens with seen > 0 get x / p where x > 0, else x * p (penalty [N], seen [N, V])."""
    p = penalty.unsqueeze(1)
    penalised = torch.where(x > 0, x / p, x * p)
    x.copy_(torch.where(seen > 0, penalised, x))


def apply_frequency_presence(x: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                             counts: torch.Tensor) -> None:
    """In place: x -= frequency * counts + presence * (counts > 0) (OpenAI's formula)."""
    x.sub_(frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0).to(x.dtype))
