"""Rows of cat([first, second]) picked by an index, without building the concatenation when the
picked rows are few.

A decode step's attention reads each row's window records from "the SWA ring, then this step's new
records" (forward_meta.StepInputs.swa_idx). Concatenating the two copies the whole ring, every slot's
window, in every layer of every step, to gather a few rows from it: at V4.1-Flash serving shapes (65
slots of 128 records of 512 bf16 values) that is 8.5 MB a layer, read and written again, against
~1 MB gathered for 8 decode rows; with the compressor state rings (gathered the same way) it was
0.34 GiB of a 1-row step's reads (tools/memory_report.py --cache-slots 65). Gathering from each source and
choosing per index moves only the rows asked for. The rows are the same bits either way (pure data
movement), so where the concatenation is the cheaper move (a prompt chunk gathers more rows than
the ring holds) it is still used. Indices are never negative here (forward_meta.addr).
"""
import torch


def concat_sources(first: torch.Tensor, second: torch.Tensor, num_indices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (first, second) to pass to concat_rows for `num_indices` indices over several calls (a step's
    row chunks): the concatenation, built once, and nothing after it when that is the cheaper move."""
    # the two gathers and the choice move ~3 rows an index; the concatenation n + m rows, then the gather
    if second.shape[0] and 3 * num_indices >= first.shape[0] + second.shape[0]:
        return torch.cat([first, second.to(first.dtype)]), second[:0]
    return first, second


def concat_rows(first: torch.Tensor, second: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """torch.cat([first, second])[idx] (second cast to first's dtype), idx >= 0."""
    first, second = concat_sources(first, second, idx.numel())
    n, m = first.shape[0], second.shape[0]
    if m == 0:
        return first[idx]
    second = second.to(first.dtype)
    from_first = first[idx.clamp(max=n - 1)]
    from_second = second[(idx - n).clamp(min=0, max=m - 1)]
    take_first = (idx < n).reshape(*idx.shape, *([1] * (first.dim() - 1)))
    return torch.where(take_first, from_first, from_second)
