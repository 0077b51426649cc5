"""Shared by the LM-head kernel tests (tests/unit/test_bf16_rows_gemm.py, test_bf16_tiles_gemm.py):
operands, the fp32 dot-product error bound, a model holding only a head, one torch thread, and
whether an engine's head takes the tiles kernel (tests/engine/test_head_argmax.py, test_cpu_compiled.py)."""
import contextlib

import pytest
import torch
from torch import nn


def operands(m, v, d, seed=0, scale=1.0):
    """h fp32 [m, d] and a bf16 weight [v, d]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, d, generator=g) * scale
    w = (torch.randn(v, d, generator=g) * 0.05).to(torch.bfloat16)
    return h, w


def within_fp32_rounding(out, h, w) -> bool:
    """|out - exact| within a dot product's fp32 error bound, d * eps * sum |h_i w_i| (with margin)."""
    exact = h.double() @ w.double().t()
    bound = h.shape[1] * 2.0 ** -23 * (h.double().abs() @ w.double().abs().t())
    return bool(((out.double() - exact).abs() <= bound + 1e-30).all())


def model_with_head(weight: torch.Tensor) -> nn.Module:
    model = nn.Module()
    model.head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.head.weight.data = weight
    return model


@contextlib.contextmanager
def torch_threads(n: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """The test runs with one torch thread (the head kernels serve one-thread ranks only)."""
    with torch_threads(1):
        yield


def has_tiles_head(llm) -> bool:
    """Whether an engine's LM head carries the platform's packed copy for the AMX tiles kernel (a CPU
    with a usable AMX unit, one thread): where greedy rows get the head's argmax."""
    copy = getattr(llm.llm_engine.worker.model.head, "weight_bf16", None)
    return copy is not None and copy.dim() == 5
