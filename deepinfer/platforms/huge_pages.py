"""Host tensors on transparent huge pages: a tensor read whole every step (the bf16 LM head copy,
layers/head_gemm.py) streams through the TLB 512 times less often on 2 MiB pages than on 4 KiB ones.

Measured on this project's machines (one thread, the 129,280 x 256 head packed for the AMX kernel,
`bf16_tiles_gemm` on a 4 KiB-page copy against a huge-page one, alternated 30 times): 4.69 -> 3.80,
6.19 -> 4.41 and 5.34 -> 4.12 ms at 1, 1 and 4 rows, 10.7 -> 9.0 ms at 32 (medians).

Linux's default THP mode on these machines is `madvise`: only ranges a process marks get huge pages,
and only pages first touched after the mark. So the tensor gets a fresh anonymous mapping, marked
MADV_HUGEPAGE before anything writes to it, 2 MiB larger than asked so the tensor can start on a
2 MiB boundary. Where THP is off (`never`), on other systems, or for tensors under 2 MiB, a plain
torch.empty."""
from __future__ import annotations

import logging
import math
import mmap
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """'always', 'madvise' or 'never' (the bracketed choice), None where the kernel does not say."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    return text.partition("[")[2].partition("]")[0] or None


def huge_page_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on transparent huge pages where this system can give them
    (module docstring). Its memory lives as long as the tensor (torch.frombuffer keeps the mapping)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (nbytes < HUGE_PAGE or not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise")
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.empty(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which follows another THP setting (shmem_enabled)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:   # the mapping still works, on small pages
        logger.info("huge pages: madvise refused (%s); small pages", e)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t (any strides) on huge pages (huge_page_empty), same shape,
    dtype and values."""
    out = huge_page_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
