"""What a request changes on its raw logits before temperature, as batched tensor ops on [N, V].

In the order vLLM applies them (the grammar mask first, then logit bias, then the penalties):
  1. grammar bitmask: a token whose bit is 0 gets -inf (packed 32 tokens per int32 word, bit
     i % 32 of word i // 32, xgrammar's layout);
  2. logit_bias: x[r, t] += bias;
  3. repetition_penalty p (vLLM): a token seen in the prompt or the output gets x / p if x > 0,
     else x * p;
  4. frequency_penalty f: x -= f * (times the token was generated);
  5. presence_penalty q: x -= q * (1 if the token was generated).

The token histories arrive as flat (row, token id) pairs built on the host, and the penalties
touch only those entries (gather / scatter, accumulate=True for counts): the cost follows the
history length, not rows x vocab. Nothing here reads device data back (no host syncs), and a row's
result depends only on its own history and parameters.
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


def apply_repetition_penalty(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                             penalty: torch.Tensor) -> None:
    """In place, at each (rows[j], ids[j]) (unique pairs: the prompt and output ids of a row):
    x / p where x > 0, else x * p, with p = penalty[rows[j]]."""
    vals = x[rows, ids]
    p = penalty.index_select(0, rows)
    x[rows, ids] = torch.where(vals > 0, vals / p, vals * p)


def apply_frequency_presence(x: torch.Tensor, out_rows: torch.Tensor, out_ids: torch.Tensor,
                             uniq_rows: torch.Tensor, uniq_ids: torch.Tensor,
                             frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """In place: x -= frequency * count + presence * (count > 0) (OpenAI's formula). out_* has one
    pair per generated token (so accumulating gives the count), uniq_* one per distinct token."""
    x.index_put_((out_rows, out_ids), -frequency.index_select(0, out_rows), accumulate=True)
    x.index_put_((uniq_rows, uniq_ids), -presence.index_select(0, uniq_rows), accumulate=True)
