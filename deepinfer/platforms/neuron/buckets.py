"""Neuron buckets (docs/neuron.md §5.1, §5.10). The bucket spec and static step padding every graph
runner shares live in model_executor/static_step.py.

The defaults keep the compile budget small (docs/neuron.md §5.10): every bucket costs one graph per
layer kind (three per kind for a split multi-row step), and a graph costs minutes of neuronx-cc.
"""
from deepinfer.model_executor.static_step import next_pow2

# Decode reads every weight once a step whatever its rows (docs/neuron.md §1.3), so padding rows is
# nearly free up to here; 8 also compiles where 6 rows failed (§4 B3).
SMALL_ROW_BUCKET = 8


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to next_pow2(max_num_seqs): 6-row graphs fail on device, 4 and 8 work (B3)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return tuple(out + [b])


def default_row_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The full batch (next_pow2(max_num_seqs)) and, below it, one small bucket of 8 rows."""
    full = batch_buckets(max_num_seqs)[-1]
    return tuple(sorted({min(SMALL_ROW_BUCKET, full), full}))


def default_context_buckets(max_model_len: int | None) -> tuple[int, ...] | None:
    """One context bucket, max_model_len (None: the power-of-two ladder of BucketSpec, which needs
    max_model_len to be bounded at warm-up)."""
    return None if max_model_len is None else (int(max_model_len),)


def check_prompt_buckets(env_name: str, buckets, max_num_batched_tokens: int) -> None:
    """Prompt-chunk buckets named by `env_name` (the Neuron or cpu platform's variable): each at least
    2 tokens and at most max_num_batched_tokens (a larger one is never filled, and every step it
    took would pad to it)."""
    limit = int(max_num_batched_tokens)
    if buckets and (min(buckets) < 2 or max(buckets) > limit):
        raise ValueError(f"{env_name}: every bucket must be >= 2 and <= max_num_batched_tokens ({limit}), "
                         f"got {buckets}")


def default_verify_rows(rows: tuple[int, ...], verify_tokens: int) -> tuple[int, ...]:
    """The row buckets whose verification bucket (rows x verify_tokens up to a power of two) holds at
    most the largest row bucket's tokens: e.g. 8 rows x 6 = 48 -> 64 tokens, the decode bucket of 64
    rows, whose graphs it shares (BucketSpec.verify_shares_decode rounds 16 or 32 up to 64 too; a
    verification step runs one region a layer, regions.SPLIT_POLICIES).
    Larger verification steps run in the prompt bucket rather than compile a bucket of their own (a
    whole-layer bucket is 13 graphs of V4.1-Flash: 11 layer kinds, entry and exit). At least the
    smallest row bucket keeps one."""
    if verify_tokens <= 1:
        return tuple(rows)
    fit = tuple(r for r in rows if next_pow2(r * verify_tokens) <= max(rows))
    return fit or (min(rows),)
