"""concat_rows (model_executor/layers/concat_rows.py): the rows of cat([first, second])[idx], bit for
bit, by either move (two gathers and a choice, or the concatenation), for record dtypes the caches hold."""
import pytest
import torch

from deepinfer.model_executor.layers.concat_rows import concat_rows, concat_sources


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("n, m, shape", [(64, 3, (2, 5)), (64, 3, (40, 8)), (8, 0, (2, 3)), (10, 20, (4,))])
def test_the_rows_of_the_concatenation(dtype, n, m, shape):
    g = torch.Generator().manual_seed(n * 100 + m)
    first = torch.randint(0, 255, (n, 6), generator=g).to(dtype)
    second = torch.randint(0, 255, (m, 6), generator=g).to(dtype)
    idx = torch.randint(0, n + m, shape, generator=g)
    got = concat_rows(first, second, idx)
    want = torch.cat([first, second])[idx]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8) if dtype != torch.uint8 else got,
                       want.view(torch.uint8) if dtype != torch.uint8 else want)


def test_few_rows_do_not_copy_the_first_source():
    """A decode-sized gather makes no tensor of the first source's size (the concatenation's)."""
    first, second = torch.zeros(4096, 8), torch.ones(2, 8)
    idx = torch.tensor([[4095, 4096, 4097, 0]])
    sizes = []

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out
    with Sizes():
        got = concat_rows(first, second, idx)
    assert torch.equal(got, torch.cat([first, second])[idx])
    assert max(sizes) < first.numel()


def test_sources_shared_by_row_chunks():
    """concat_sources builds the concatenation once where many rows gather, else keeps both sources;
    row chunks gathering from what it returns get the concatenation's rows."""
    first, second = torch.arange(40.).view(20, 2), torch.arange(100., 106.).view(3, 2)
    many = torch.randint(0, 23, (30, 4), generator=torch.Generator().manual_seed(1))
    a, b = concat_sources(first, second, many.numel())
    assert a.shape[0] == 23 and b.shape[0] == 0
    few = torch.tensor([[19, 20, 22]])
    a, b = concat_sources(first, second, few.numel())
    assert a is first and b is second
    for idx, src in ((many, concat_sources(first, second, many.numel())), (few, (first, second))):
        for chunk in idx.split(7):
            assert torch.equal(concat_rows(*src, chunk), torch.cat([first, second])[chunk])
