"""The LM head's local GEMM: fp32 logits of hidden rows against this rank's head weight (the whole
vocabulary on one rank, a vocabulary shard on a vocabulary-parallel head).

Orientation, by measurement (`examples/bench/bench_small_gemm.py`, README "Weight formats"): an fp32
head lives in [D, V] memory order (models/deepseek_v4.py post_load), so `h @ W.t()` is one sgemm
over a contiguous [D, V] matrix. On the project's 2-core CPUs that is the fastest orientation at 1 and
4 rows and within the noise at 8 rows; F.linear over the row-major [V, D] weight was faster only at
2 rows and W @ h.T only at 16, and holding a second layout for those would double the head's bytes.
bf16 heads stay row-major, where the plain `h @ W.t()` is the fastest form.

An fp32 head whose values are all bf16 may also carry a bf16 copy (the cpu platform adds it on ranks of
one thread: platforms/cpu.py, DEEPINFER_CPU_BF16_HEAD): up to BF16_KERNEL_MAX_ROWS rows then go
through the bf16-weight kernel (layers/bf16_rows_gemm.py), which computes the same fp32 products from
half the bytes. Measured on this 2-core machine, one thread, the 129,280 x 256 head, variants
alternated (`examples/bench/bench_bf16_head.py`): fp32 GEMM / kernel 1.96 at 1 row, 2.21 at 2, 2.09 at
4, 1.89 at 8, 1.32 at 16 and 0.93 at 32, where the arithmetic is the limit (the fp32 GEMM runs at
about one 16-wide FMA a cycle there, and so does the kernel). The head is 132 MB as fp32 and 66 MB
as bf16 against a 300 MiB L3 shared with other machines: how much of either stays cached between
steps varies, and so do these times (the kernel took 2.4-4.7 ms at 1 row across runs).

Where the CPU has AMX the platform packs the copy for the tiles kernel instead (layers/bf16_tiles_gemm.py,
the fp32 products computed on the matrix unit from an exact three-part bf16 split of h), which takes
every row count: fp32 GEMM / tiles kernel 1.75-1.84 at 1 row, 2.8 at 2, 3.3 at 4, 4.1 at 8 and 16,
2.6-3.0 at 32, 1.6-1.9 at 64 and 1.5-1.7 at 128, the vector kernel 1.7 / 2.4 / 2.3 / 2.2 / 1.6-1.7 /
1.1 / 0.7 / 0.9 in the same runs (same command, a busier machine than the figures above)."""
import torch

from deepinfer.model_executor.layers import bf16_rows_gemm, bf16_tiles_gemm  # noqa: F401  (register the ops)

BF16_KERNEL_MAX_ROWS = 16


def head_logits(h: torch.Tensor, weight: torch.Tensor, bf16_weight: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, D] @ weight[V, D]^T -> fp32 [T, V]; bf16_weight: the same values as bf16, row-major [V, D]
    for the rows kernel or packed [V/16, D/32, 16, 16, 2] for the tiles kernel, or None."""
    copy = _kernel_copy(h, weight, bf16_weight)
    if copy is not None:
        if copy.dim() == 5:   # packed for the AMX tiles kernel: faster at every row count measured
            return torch.ops.deepinfer.bf16_tiles_gemm(h, copy)
        if h.shape[0] <= BF16_KERNEL_MAX_ROWS:
            return torch.ops.deepinfer.bf16_rows_gemm(h, copy)
    return (h @ weight.t()).float()


def _kernel_copy(h: torch.Tensor, weight: torch.Tensor, bf16_weight: torch.Tensor | None) -> torch.Tensor | None:
    """bf16_weight when a bf16-weight kernel may take these rows, else None: fp32 rows, and no step that
    trains the head (the kernels have no backward; such a step takes the GEMM)."""
    training = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return bf16_weight if bf16_weight is not None and not training and h.dtype == torch.float32 else None


def head_logits_argmax(h: torch.Tensor, weight: torch.Tensor,
                       bf16_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(head_logits(h, weight, bf16_weight), each row's argmax [T] int64 or None): the tiles kernel
    finds the argmax while it stores the logits (layers/bf16_tiles_gemm.py), saving a greedy step
    the second read of [T, V] logits; the other forms return None (the sampler then scans them)."""
    copy = _kernel_copy(h, weight, bf16_weight)
    if copy is not None and copy.dim() == 5 and copy.shape[0] > 0:
        return torch.ops.deepinfer.bf16_tiles_gemm_argmax(h, copy)
    return head_logits(h, weight, bf16_weight), None

