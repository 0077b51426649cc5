"""Neuron buckets (docs/neuron.md §5.1, §5.10). The bucket spec and static step padding every graph
runner shares live in model_executor/static_step.py.

The defaults keep the compile budget small (docs/neuron.md §5.10): every bucket costs one graph per
layer kind (three per kind for a split multi-row step), and a graph costs minutes of neuronx-cc.
"""

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
