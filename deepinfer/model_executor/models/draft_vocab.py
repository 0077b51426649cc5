"""A draft vocabulary: the token ids DSpark drafts may take, so the draft heads read only their rows.

Why. A greedy speculative step reads the vocabulary-wide heads three ways: the verification rows' LM
head, then the draft block's base logits through the same LM head (they depend on what verification
accepted, so the two reads cannot be one), then one Markov head a draft depth. On a CPU every one of
those reads is the whole head's bytes (66 MB for the tiny checkpoints' 129,280 x 256 bf16 head), so a
speculative step costs about two plain steps (README, "Trained tiny model"). Drafts need not cover the
vocabulary: a draft only decides what verification checks, never what a request gets. So the draft
heads may score a subset S of the vocabulary, the most frequent tokens of a corpus
(examples/tools/build_draft_vocab.py ranks them): the draft's LM-head and Markov-head reads shrink to
|S| rows, and verification keeps the whole vocabulary. The cost is acceptance: a token outside S is
never drafted, so where it comes next the draft is wrong at that depth.

What stays exact. Greedy tokens are verification's argmaxes over the whole vocabulary, so they do not
change. A sampled request's draft distribution q is zero outside S, and rejection sampling is exact for
any q it is given (spec/verify.py), so its tokens stay distributed as the target.

Columns. The draft heads' logits have one column per entry of `ids` (ascending token ids; the lowest
column among equal logits is the lowest id, so argmax ties break the way the sampler's do). With one
head (no vocabulary split) the columns are S, padded with zero weight rows to a multiple of PAD_TO
(the AMX head kernel's tile rows, layers/bf16_tiles_gemm.py); a padded column's logit is -inf (`mask`).
With the head split over a CP group (layers/vocab_parallel.py) each rank holds the rows of S in its own
slice, padded to a width every rank shares, and the gathered columns are the ranks' blocks in rank order:
still ascending ids, pads masked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.model_executor.layers.packed_weights import is_packed

PAD_TO = 16
NEG_INF = float("-inf")


def read_draft_vocab(path: str | Path, vocab_size: int) -> list[int]:
    """The sorted, distinct token ids of a draft-vocabulary file: a JSON object whose "token_ids" is a
    list of ints in [0, vocab_size) (build_draft_vocab.py writes one). Raises ValueError on anything else."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"draft vocabulary {path}: cannot read a JSON file ({e})") from e
    ids = doc.get("token_ids") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"draft vocabulary {path}: expected an object with a non-empty list \"token_ids\"")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"draft vocabulary {path}: token ids must be ints in [0, {vocab_size}); "
                         f"got {bad[:5]}{' ...' if len(bad) > 5 else ''}")
    return sorted(set(ids))


def rank_tokens(counts: dict[int, int], size: int) -> list[int]:
    """The `size` most frequent ids of `counts` (more frequent first; equal counts: lowest id first),
    returned ascending: a draft vocabulary."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return sorted(t for t, _ in ranked)


@dataclass
class DraftColumns:
    """The column layout of the draft heads (module docstring)."""
    ids: torch.Tensor        # int64 [C]: token id of each gathered column (0 at a pad column, masked)
    mask: torch.Tensor       # fp32 [C]: 0, or -inf at a pad column
    real: torch.Tensor       # int64 [|S|]: the columns that hold a token, ascending
    local_rows: torch.Tensor  # int64 [m]: this rank's head row of each of its m columns (pads: row 0)
    local_real: torch.Tensor  # bool [m]: whether each of this rank's columns holds a token

    @classmethod
    def build(cls, token_ids: list[int], shard=None) -> DraftColumns:
        """Columns of `token_ids` (sorted, distinct) for one head (shard None) or this rank's slice of a
        split one (a VocabShard: start, size, world)."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        if shard is None:
            blocks, rank, start = [ids], 0, 0
        else:
            edges = [r * shard.size for r in range(shard.world + 1)]
            blocks = [ids[(ids >= lo) & (ids < hi)] for lo, hi in zip(edges, edges[1:])]
            rank, start = shard.start // shard.size, shard.start
        m = -(-max(len(b) for b in blocks) // PAD_TO) * PAD_TO
        col_ids = torch.zeros(len(blocks) * m, dtype=torch.long)
        mask = torch.full((len(blocks) * m,), NEG_INF)
        for r, b in enumerate(blocks):
            col_ids[r * m:r * m + len(b)] = b
            mask[r * m:r * m + len(b)] = 0.0
        own = blocks[rank]
        local_rows = torch.zeros(m, dtype=torch.long)
        local_rows[:len(own)] = own - start
        local_real = torch.arange(m) < len(own)
        return cls(col_ids, mask, torch.nonzero(mask == 0).flatten(), local_rows, local_real)


def dense_rows(lin: nn.Module, rows: torch.Tensor, real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), in] rows of a dense linear's [out, in] weight, zero where `real` is False. A packed
    weight (layers/packed_weights.py; the checkpoints store both heads in bf16) is refused."""
    if is_packed(lin):
        raise ValueError("a draft vocabulary needs dense LM and Markov heads; this one is packed "
                         f"({type(lin).__name__})")
    out = lin.weight.detach().index_select(0, rows).to(dtype).contiguous()
    out[~real] = 0
    if out.dtype == torch.float32:   # the [in, out] memory order of every fp32 linear (DeepseekV4Model.post_load)
        out = out.t().contiguous().t()
    return out


class DraftHead(nn.Module):
    """A head over the draft columns: `weight` [m, in] is a non-persistent buffer, so the state dict,
    and the checkpoint comparison, stay those of the checkpoint's tensors; a platform may add
    `weight_bf16` as it does to the LM head (platforms/cpu.py keep_bf16_head)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)


class DraftVocab(nn.Module):
    """The model's draft vocabulary (DeepseekV4Model.use_draft_vocab): the LM head's and the Markov
    head's rows of its columns, and the columns' ids and mask (buffers, moved with the model)."""

    def __init__(self, cols: DraftColumns, head: torch.Tensor, markov: torch.Tensor):
        super().__init__()
        self.head = DraftHead(head)        # [m, D]: this rank's columns of the LM head
        self.markov = DraftHead(markov)    # [C, r]: every column of the Markov head (replicated)
        self.register_buffer("ids", cols.ids, persistent=False)
        self.register_buffer("mask", cols.mask, persistent=False)
        self.register_buffer("real", cols.real, persistent=False)

    def expand(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V] fp32 logits from [N, C] column logits: -inf outside the draft vocabulary (what a
        sampler then gives zero probability)."""
        full = torch.full((logits.shape[0], vocab_size), NEG_INF, dtype=logits.dtype, device=logits.device)
        return full.index_copy_(1, self.ids.index_select(0, self.real), logits.index_select(1, self.real))
