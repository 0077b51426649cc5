"""Neuron batch buckets (docs/neuron.md §5.1). The bucket spec and static step padding every graph
runner shares live in model_executor/static_step.py."""


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to next_pow2(max_num_seqs): 6-row graphs fail on device, 4 and 8 work (B3)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return tuple(out + [b])
