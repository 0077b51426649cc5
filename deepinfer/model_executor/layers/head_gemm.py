"""The LM head's local GEMM: fp32 logits of hidden rows against this rank's head weight (the whole
vocabulary on one rank, a vocabulary shard on a vocabulary-parallel head).

Orientation, by measurement (`examples/bench/bench_small_gemm.py`, README "Weight formats"): an fp32
head lives in [D, V] memory order (models/deepseek_v4.py post_load), so `h @ W.t()` is one sgemm
over a contiguous [D, V] matrix. On the project's 2-core CPUs that is the fastest orientation at 1 and
4 rows and within the noise at 8 rows; F.linear over the row-major [V, D] weight was faster only at
2 rows and W @ h.T only at 16, and holding a second layout for those would double the head's bytes.
bf16 heads stay row-major, where the plain `h @ W.t()` is the fastest form."""
import torch


def head_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [T, D] @ weight[V, D]^T -> fp32 [T, V]."""
    return (h @ weight.t()).float()
