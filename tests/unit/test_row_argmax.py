"""layers/row_argmax.py first_argmax equals torch.argmax: random rows, ties, NaN, -inf, a short tail."""
import pytest
import torch

from deepinfer.model_executor.layers.row_argmax import BLOCK, first_argmax


@pytest.mark.parametrize("vocab", [2 * BLOCK, 5 * BLOCK + 37, 1000, 129280])
def test_random_rows_match_argmax(vocab):
    x = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))


def test_ties_take_the_lowest_index_across_and_within_blocks():
    x = torch.zeros(4, 3 * BLOCK + 5)
    x[0, [BLOCK + 3, 2 * BLOCK + 1]] = 2.0          # two blocks hold the maximum
    x[1, [7, 9]] = 1.0                              # twice in one block
    x[2, -1] = 3.0                                  # the maximum is the tail's last value
    x[3] = float("-inf")                            # every value -inf: index 0
    got = first_argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [BLOCK + 3, 7, 3 * BLOCK + 4, 0]


def test_nan_counts_as_the_maximum_as_in_argmax():
    x = torch.randn(2, 4 * BLOCK, generator=torch.Generator().manual_seed(3))
    x[0, [BLOCK + 2, 3 * BLOCK]] = float("nan")
    x[1, 5] = float("inf")
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))


def test_strided_and_short_rows_fall_back():
    x = torch.randn(3 * BLOCK, 4).t()     # non-contiguous rows
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    y = torch.randn(3, 10)
    assert torch.equal(first_argmax(y), y.argmax(dim=-1))
