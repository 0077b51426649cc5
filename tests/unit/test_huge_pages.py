"""platforms/huge_pages.py: a tensor on huge pages holds what it was given, starts on a 2 MiB boundary
where the system gives huge pages, and falls back to a plain tensor where it cannot."""
import pytest
import torch

from deepinfer.platforms import huge_pages as HP


def test_a_copy_holds_the_values_and_starts_on_a_huge_page_boundary():
    t = torch.randn(3000, 256).to(torch.bfloat16)   # 1.5 MiB: too small, a plain tensor
    small = HP.on_huge_pages(t)
    assert torch.equal(small, t) and small.is_contiguous()
    big = torch.arange(5 << 19, dtype=torch.int32).view(-1, 512)   # 10 MiB
    copy = HP.on_huge_pages(big)
    assert torch.equal(copy, big) and copy.is_contiguous() and copy.shape == big.shape
    if HP.thp_mode() in ("always", "madvise"):
        assert copy.data_ptr() % HP.HUGE_PAGE == 0
    del big
    assert int(copy[-1, -1]) == (5 << 19) - 1   # the mapping lives as long as the tensor


def test_without_transparent_huge_pages_a_plain_tensor(monkeypatch):
    monkeypatch.setattr(HP, "thp_mode", lambda: "never")
    t = HP.huge_page_empty((4 << 20,), torch.uint8)
    assert t.shape == (4 << 20,) and t.dtype == torch.uint8


@pytest.mark.skipif(HP.thp_mode() is None, reason="this kernel does not report its THP mode")
def test_the_mode_is_one_the_kernel_names():
    assert HP.thp_mode() in ("always", "madvise", "never")


def _mapping_of(address: int) -> str:
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return perms
    raise AssertionError("address in no mapping")


@pytest.mark.skipif(HP.thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_the_mapping_is_private_anonymous_memory():
    # a shared anonymous mapping is shmem, which madvise-mode THP leaves on small pages
    t = HP.huge_page_empty((4 << 20,), torch.uint8)
    assert _mapping_of(t.data_ptr()).endswith("p")
